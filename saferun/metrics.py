"""Metrics kept on the device and read to the host in one sync per read."""

from __future__ import annotations

import time
from typing import Any, Mapping, Optional

import torch

from .callbacks import StepOutput
from .errors import SaferunError


class RunningTrainMetrics:
    """Collects each step's loss, grad norm, logged scalars and sample indices until a log point.

    Appending a device tensor to a list costs no sync; `read()` averages
    everything with device ops and copies the results to the host at once.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.grad_norms: list[torch.Tensor] = []
        self.logs: list[Mapping[str, torch.Tensor]] = []
        self.batches: list[Any] = []  # per step: (epoch, [sample indices per micro-batch]) or None
        self.samples = 0
        self.skipped = 0
        self.started = time.perf_counter()

    @property
    def steps(self) -> int:
        return len(self.losses) + self.skipped

    def add(self, output: StepOutput, batches: Any = None) -> None:
        self.samples += output.num_samples
        if output.skipped:
            self.skipped += 1
            return
        self.losses.append(output.loss)
        self.grad_norms.append(output.grad_norm)
        if output.logs:
            self.logs.append(output.logs)
        self.batches.append(batches)

    def state_dict(self) -> dict[str, Any]:
        """The values collected since the last log point (so a resumed run logs the same means)."""
        return {"losses": list(self.losses), "grad_norms": list(self.grad_norms),
                "logs": [dict(d) for d in self.logs], "batches": list(self.batches),
                "samples": self.samples, "skipped": self.skipped}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.reset()
        self.losses, self.grad_norms = list(state["losses"]), list(state["grad_norms"])
        self.logs, self.batches = [dict(d) for d in state["logs"]], list(state["batches"])
        self.samples, self.skipped = state["samples"], state["skipped"]

    def read(self, extra: Mapping[str, torch.Tensor] = {}) -> dict[str, float]:
        """Means since the last reset, throughput and `extra`: the one host sync of a log point."""
        keys = list(self.logs[0]) if self.logs else []
        names, columns = [], []
        if self.losses:
            names += ["train/loss", "train/grad_norm"] + [f"train/{k}" for k in keys]
            columns += [_mean(self.losses), _mean(self.grad_norms)]
            columns += [_mean([d[k] for d in self.logs]) for k in keys]
        names += list(extra)
        columns += [v.detach().float() for v in extra.values()]
        values = torch.stack(columns).tolist() if columns else []
        seconds = max(time.perf_counter() - self.started, 1e-9)
        metrics = dict(zip(names, values))
        metrics["perf/steps_per_sec"] = self.steps / seconds
        metrics["perf/samples_per_sec"] = self.samples / seconds
        if self.skipped:
            metrics["train/skipped_steps"] = float(self.skipped)
        return metrics

    def first_nonfinite(self, check_grads: bool = True) -> Optional[int]:
        """Position (in this window) of the first step with a non-finite loss or grad norm."""
        losses = torch.stack(self.losses).float()
        bad = ~torch.isfinite(losses)
        if check_grads:
            bad |= ~torch.isfinite(torch.stack(self.grad_norms).float())
        found = bad.nonzero().flatten().tolist()
        return found[0] if found else None


class WeightedMeans:
    """Per-key means over batches, weighted by batch size, summed on the device."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.count = 0

    def add(self, values: Mapping[str, torch.Tensor], n: int) -> None:
        for k, v in values.items():
            weighted = v.detach().float() * n
            self.sums[k] = self.sums[k] + weighted if k in self.sums else weighted
        self.count += n

    def read(self) -> dict[str, float]:
        if not self.sums or self.count == 0:
            return {}
        totals = torch.stack(list(self.sums.values())).tolist()  # the one host sync
        return {k: total / self.count for k, total in zip(self.sums, totals)}


def scalar_dict(out: object, where: str) -> dict[str, torch.Tensor]:
    """Check that `out` maps names to scalar tensors (or numbers); name the offender if not."""
    if not isinstance(out, Mapping):
        raise SaferunError(
            f"{where} must return a dict of scalar tensors, got {type(out).__name__}. "
            f"Return e.g. {{'loss': loss, 'acc': acc}}."
        )
    checked: dict[str, torch.Tensor] = {}
    for k, v in out.items():
        if isinstance(v, (int, float)):
            v = torch.tensor(float(v))
        if not isinstance(v, torch.Tensor) or v.ndim != 0:
            shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise SaferunError(
                f"{where} returned {k!r} = {shape}, not a scalar. Reduce it over the batch "
                f"(e.g. .mean()) so saferun can average it over batches."
            )
        checked[str(k)] = v
    return checked


def _mean(values: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(values).float().mean()
