"""The throughput report: what runs are compared by, logged as perf/* at log points.

- perf/steps_per_sec, perf/samples_per_sec: from the log window's host clock (loop/metrics.py);
- perf/tokens_per_sec: samples/s times the tokens in a sample, where the Trainer says
  (`Trainer.tokens_per_sample`, e.g. a language model's sequence length);
- perf/flops_per_step: the model's forward and backward FLOPs of one optimizer step, counted once,
  on the first step of the fit (torch's `FlopCounterMode`: matmuls, convolutions, attention, from
  the shapes alone, no host read); perf/tflops_per_sec with the steps per second;
- perf/mfu: model FLOPs utilisation, those FLOP/s over the device's peak, where saferun knows the
  peak (`PEAK_TFLOPS`: dense bf16/fp16 tensor-core peaks of common GPUs, for trainer.precision
  bf16 or fp16); on a CPU, in fp32, or on a GPU not in the table the peak is unknown and the
  report says so once.

The `saferun` command's summary.json holds the final log point's perf/* with the other metrics.

Nothing here runs between log points but the one counted step.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable, Optional

import torch

log = logging.getLogger("saferun")

# Dense (no 2:4 sparsity) tensor-core peak per GPU in TFLOP/s, and the precisions it holds for:
# vendors' data sheets print the sparse figure first, twice the dense one (H100 SXM bf16: 1979
# sparse, 989.4 dense). Matched in order, as a whole word, in torch.cuda.get_device_name() (A10
# is not A10G, V100 not V100S); None: a GPU whose peak saferun does not know for sure (the NVL
# parts run at lower clocks than the SXM ones), so no MFU rather than a wrong one.
_BOTH, _FP16 = ("bf16", "fp16"), ("fp16",)  # Volta and Turing have no bf16 tensor cores
PEAK_TFLOPS: tuple[tuple[str, Optional[float], tuple[str, ...]], ...] = (
    ("H200 NVL", None, _BOTH),
    ("H200", 989.4, _BOTH),  # the H100 SXM's chip and clocks, more memory
    ("H100 NVL", None, _BOTH),
    ("H100 PCIe", 756.0, _BOTH),  # 1513 sparse
    ("H100", 989.4, _BOTH),  # SXM5
    ("A100", 312.0, _BOTH),  # SXM4 and PCIe alike (624 sparse)
    ("L40S", 362.0, _BOTH),  # 362.05 (733 sparse)
    ("L4", 121.0, _BOTH),  # 242 sparse
    ("A10", 125.0, _BOTH),  # 250 sparse
    ("V100-PCIE", 112.0, _FP16),
    ("V100", 125.0, _FP16),  # SXM2; no sparsity on Volta
    ("T4", 65.0, _FP16),  # no sparsity figure on Turing's data sheet
)


def peak_tflops(device: torch.device, precision: str) -> tuple[Optional[float], str]:
    """(the device's peak TFLOP/s for `precision`, or None; what it is, in words)."""
    if device.type != "cuda":
        return None, f"unknown peak on {device.type}"
    return peak_for(torch.cuda.get_device_name(device), precision)


def peak_for(name: str, precision: str) -> tuple[Optional[float], str]:
    """`peak_tflops` for the GPU called `name`."""
    if precision not in ("bf16", "fp16"):
        return None, f"unknown peak for {precision} on {name} (the table holds bf16/fp16 peaks)"
    for key, tflops, precisions in PEAK_TFLOPS:
        if re.search(rf"\b{re.escape(key)}\b", name):
            if tflops is None or precision not in precisions:
                break
            return tflops, f"{name}, peak {tflops:g} TFLOP/s ({precision}, dense)"
    return None, f"unknown peak for {precision} on {name}"


class Throughput:
    """Counts the FLOPs of one step once and turns a log point's steps and samples per second
    into the perf/* report.

    Args:
        device: the training device; precision: trainer.precision (the peak depends on it).
        tokens_per_sample: tokens in one sample, or None where the task does not say.
        countable: whether FLOPs can be counted here (not under torch.compile or sharding,
            where a dispatch mode would meet compiled graphs or DTensors).
        say: log what was counted, and the peak (rank 0).
    """

    def __init__(self, device: torch.device, precision: str, tokens_per_sample: Optional[int],
                 countable: bool, say: bool = True) -> None:
        self.tokens_per_sample = tokens_per_sample
        self.peak, self.peak_said = peak_tflops(device, precision)
        self.countable, self.say = countable, say
        self.flops_per_step: Optional[int] = None

    @property
    def counting(self) -> bool:
        """The next step should be counted (once per Trainer)."""
        return self.countable and self.flops_per_step is None

    def counted(self, flops: int) -> None:
        """Keep the first step's count (`FlopCount`) and say it."""
        self.flops_per_step = flops
        if self.say:
            log.info("perf: %.4g FLOPs per step (forward and backward, counted on this fit's first "
                     "step); MFU: %s.", self.flops_per_step, self.peak_said)

    def at_log_point(self, metrics: dict[str, float]) -> None:
        """Add the perf/* figures that follow from `metrics`' steps and samples per second."""
        if self.tokens_per_sample is not None:
            metrics["perf/tokens_per_sec"] = metrics["perf/samples_per_sec"] * self.tokens_per_sample
        if self.flops_per_step:  # (0: nothing counted, e.g. a model without matmuls)
            flops = self.flops_per_step * metrics["perf/steps_per_sec"]
            metrics["perf/flops_per_step"] = float(self.flops_per_step)
            metrics["perf/tflops_per_sec"] = flops / 1e12
            if self.peak is not None:
                metrics["perf/mfu"] = flops / (self.peak * 1e12)


class FlopCount:
    """The count of the first step's FLOPs in the step frame (loop/frame.py): each of its
    micro-batches (training_step and backward) runs under torch's FLOP counter; after the last,
    the total goes to `perf` and the count is done, so later steps run uncounted."""

    def __init__(self, perf: Throughput) -> None:
        self._perf, self._total = perf, 0
        self.done = False

    def __call__(self, run: Callable[[], Any], last: bool) -> Any:
        from torch.utils.flop_counter import FlopCounterMode

        counter = FlopCounterMode(display=False)
        with counter:
            out = run()
        self._total += counter.get_total_flops()
        if last:
            self.done = True
            self._perf.counted(self._total)
        return out
