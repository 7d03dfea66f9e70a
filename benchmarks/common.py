"""What the three benchmark variants share: the job, the workloads and the step clock.

Every variant seeds torch with `job.seed`, builds the model from `build_model`, reads the
datasets from `build_datasets` in the order `epoch_seed` fixes, and trains with AdamW,
gradient clipping and the same log and validation schedule. Their final validation metrics
therefore agree, which shows that they did the same work.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset


@dataclass(frozen=True)
class Job:
    """One training run, identical for every variant."""

    workload: str  # "mlp", "cnn" or "charlm"
    device: str  # "cpu" or "cuda"
    steps: int
    log_every: int  # read the running loss to the host every this many steps
    val_every: int  # validate every this many steps (and so after the last one)
    warmup: int  # steps left out of the timing window
    run_dir: str  # TensorBoard event files and checkpoints go here
    save_every: int = 1000  # checkpoint every this many steps (saferun's default)
    batch_size: int = 64
    lr: float = 1e-3
    max_grad_norm: float = 1.0
    seed: int = 0
    guards: Optional[dict] = None  # saferun only: guards config keys over the defaults

    @property
    def precision(self) -> str:
        """bf16 autocast on CUDA, plain fp32 on the CPU."""
        return "bf16" if self.device == "cuda" else "fp32"


# Sizes of the synthetic data: (train samples, validation samples).
SIZES = {"mlp": (8192, 1024), "cnn": (2048, 512)}
CHARLM_CHARS = 300_000  # the charlm recipe's corpus (Python's standard library), first characters


class SequenceLogits(nn.Module):
    """The charlm recipe's Transformer with its logits as (B, vocab, T): cross_entropy and the
    accuracy's argmax(1) then read them as they read a classifier's, in every variant."""

    def __init__(self) -> None:
        super().__init__()
        from saferun.recipes.charlm import CharTransformer  # the recipe's model, as configured

        self.lm = CharTransformer(context=64, d_model=96, layers=2, heads=4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(ids).transpose(1, 2)


def build_model(workload: str) -> nn.Module:
    """The model, drawn from torch's global RNG (seed it first)."""
    if workload == "mlp":  # 6,922 parameters: per-op overhead dominates the step
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                             nn.Linear(64, 10))
    if workload == "cnn":  # about 10k parameters, but ~50x the MLP's arithmetic per step
        return nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(32 * 4 * 4, 10),
        )
    if workload == "charlm":  # about 230k parameters: attention, LayerNorm, GELU, embeddings
        return SequenceLogits()
    raise ValueError(f"unknown workload {workload!r}; use mlp, cnn or charlm")


def build_datasets(workload: str) -> tuple[TensorDataset, TensorDataset]:
    """Learnable synthetic classification data held in memory, from a private generator; for
    charlm, the recipe's corpus in consecutive windows (no random draws: every variant sees the
    same samples without sharing a Python RNG)."""
    if workload == "charlm":
        from saferun.recipes.charlm import CharDataset, encode, read_corpus

        ids = encode(read_corpus(None, CHARLM_CHARS))
        n_val = len(ids) // 10
        return (CharDataset(ids[:-n_val], context=64, samples=None),  # type: ignore[return-value]
                CharDataset(ids[-n_val:], context=64, samples=None))
    n_train, n_val = SIZES[workload]
    g = torch.Generator().manual_seed(1234)  # private: leaves the global RNG to the model
    if workload == "mlp":
        x = torch.randn(n_train + n_val, 32, generator=g)
        y = (x @ torch.randn(32, 10, generator=g)).argmax(1)
    else:
        templates = torch.randn(10, 3, 16, 16, generator=g)
        y = torch.randint(0, 10, (n_train + n_val,), generator=g)
        x = 0.3 * templates[y] + torch.randn(n_train + n_val, 3, 16, 16, generator=g)
    return (TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[n_train:], y[n_train:]))


def epoch_seed(seed: int, epoch: int) -> int:
    """Seed of the shuffling generator for `epoch`.

    The same derivation as saferun's loaders (saferun.data.seeding.derive_seed(seed, epoch, rank=0)),
    written out here so that the hand-written loop does not import saferun.
    """
    state = np.random.SeedSequence([seed, epoch, 0]).generate_state(1, np.uint64)
    return int(state[0]) & (2**63 - 1)


class CudaSyncWarnings:
    """Counts the syncs `torch.cuda.set_sync_debug_mode("warn")` reports, as Python warnings."""

    def __init__(self) -> None:
        self._caught: list[warnings.WarningMessage] = []
        self._ctx = warnings.catch_warnings(record=True)

    @property
    def count(self) -> int:
        return sum("synchronizing CUDA operation" in str(w.message) for w in self._caught)

    def __enter__(self) -> "CudaSyncWarnings":
        self._caught = self._ctx.__enter__()  # type: ignore[assignment]
        warnings.simplefilter("always")  # every sync, not only the first from each line
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.cuda.set_sync_debug_mode("default")
        self._ctx.__exit__(*exc)


class StepClock:
    """Marks the end of every optimizer step, before that step's logging or validation.

    Each variant calls `tick()` at that point: the hand-written loop inline, saferun from
    `on_train_step_end`, Lightning from `on_train_batch_end`. In a counted run it also records
    the running sync counts, so that syncs can be pinned to the steps between log points.
    """

    def __init__(self, job: Job, host_syncs: Any = None, cuda_syncs: Optional[CudaSyncWarnings] = None
                 ) -> None:
        self.job = job
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.host_syncs = host_syncs
        self.cuda_syncs = cuda_syncs
        self.host_counts: list[int] = []
        self.cuda_counts: list[int] = []
        # On CUDA the host runs ahead of the GPU: wait for it at both ends of the timing
        # window. Never in a counted run, where that wait would be a sync of our own.
        counting = host_syncs is not None or cuda_syncs is not None
        self._wait_at = {job.warmup, job.steps} if job.device == "cuda" and not counting else set()

    def tick(self) -> None:
        if len(self.times) + 1 in self._wait_at:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        # CPU time of this process: on a shared machine, time spent waiting for a core is
        # not in it, so it compares variants more steadily than wall time does.
        self.cpu_times.append(time.process_time())
        if self.host_syncs is not None:
            self.host_counts.append(self.host_syncs.count)
        if self.cuda_syncs is not None:
            self.cuda_counts.append(self.cuda_syncs.count)

    def timing(self) -> dict[str, float]:
        """Per step over steps warmup+1 .. steps, log points and validations included:
        mean wall time, mean CPU time, and the median wall time of a single step."""
        w, n = self.job.warmup, self.job.steps
        assert len(self.times) == n, f"{len(self.times)} ticks for {n} steps"
        wall, cpu = self.times[w - 1:], self.cpu_times[w - 1:]  # tick w ends step w
        return {"step_mean_ms": 1e3 * (wall[-1] - wall[0]) / (n - w),
                "step_cpu_ms": 1e3 * (cpu[-1] - cpu[0]) / (n - w),
                "step_median_ms": 1e3 * float(np.median(np.diff(wall)))}

    def syncs_between_log_points(self, counts: list[int]) -> dict[str, int]:
        """Syncs during the steps between log points, validations and checkpoints.

        The interval from tick k-1 to tick k holds step k-1's logging, validation and
        checkpoint (if due) and then step k. Frameworks run their hooks in different orders
        around the tick, so an interval is plain only if neither step k-1 nor step k has any
        of these events.
        """
        j = self.job

        def quiet(k: int) -> bool:
            return bool(k % j.log_every and k % j.val_every and k % j.save_every)

        plain = [k for k in range(2, len(counts) + 1) if quiet(k - 1) and quiet(k)]
        return {"plain_steps": len(plain),
                "plain_step_syncs": sum(counts[k - 1] - counts[k - 2] for k in plain)}
