"""Metrics kept on the device and read to the host in one sync per read."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch

from .. import distributed
from ..callbacks import Media, StepOutput
from ..errors import SaferunError
from .logbook import Folded

_CPU = torch.device("cpu")


class RunningTrainMetrics:
    """Collects each step's loss, grad norm, logged scalars and sample indices until a log point.

    The loss and gradient norm of each step are written into one preallocated device tensor
    (one operator, no sync, nothing kept per step: holding each step's two tensors until the
    log point cost more than the write, in the allocator and at the log point's stack);
    `read()` averages everything with device ops and copies the results to the host at once.
    """

    def __init__(self) -> None:
        # the spike guard's `flag_steps` when it compares the steps at log points (no skip
        # policy): `catch_up` flags the steps kept since it last ran, before anything reads them
        self.spike_flagger: Optional[Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = None
        self._values: Optional[torch.Tensor] = None  # (capacity, 2) float32: loss, grad norm
        self._rows: list[torch.Tensor] = []  # its rows, written with stack(out=)
        self.reset()

    def reset(self) -> None:
        self._flagged = 0  # the kept steps the spike flags cover
        self.kept = 0  # the steps whose loss and gradient norm are kept (not skipped)
        self.logs: list[Mapping[str, torch.Tensor]] = []
        self.batches: list[Any] = []  # per step: (epoch, [sample indices per micro-batch]) or None
        # when the spike guard is on: a flag per step, or (`catch_up`) a 1-D run of them
        self.spikes: list[torch.Tensor] = []
        self.loss_spikes: list[torch.Tensor] = []  # the same, for this rank's loss alone
        self.folded = Folded()  # self.log(..., reduce=min/max/sum/last) since the last log point
        self.media: list[Media] = []  # self.log_image/histogram/text, to write at the log point
        self.samples = 0
        self.skipped = 0
        self.started = time.perf_counter()

    @property
    def steps(self) -> int:
        return self.kept + self.skipped

    @property
    def values(self) -> torch.Tensor:
        """The kept steps' (loss, gradient norm), one row per step: a (kept, 2) float32 view,
        to use at once (the next `add` may move the rows to a larger tensor, `reset` reuses them)."""
        if self._values is None:
            return torch.zeros(0, 2)
        return self._values[:self.kept]

    @property
    def losses(self) -> torch.Tensor:
        """The kept steps' losses, 1-D float32 (a copy)."""
        return self.values[:, 0].contiguous()

    @property
    def grad_norms(self) -> torch.Tensor:
        """The kept steps' gradient norms, 1-D float32 (a copy)."""
        return self.values[:, 1].contiguous()

    def add(self, output: StepOutput, batches: Any = None,
            logged: Optional[tuple[Folded, list[Media]]] = None) -> None:
        """One step's output; `logged`: what its training_step self.log()ged besides means
        (dropped, as its returned values are, when the step was skipped)."""
        self.samples += output.num_samples
        if output.skipped:
            self.skipped += 1
            return
        if logged is not None:
            self.folded.merge(logged[0])
            self.media += logged[1]
        if self.kept == len(self._rows):
            # (a number, from a train_step of one's own, has no device: the CPU's)
            self._grow(getattr(output.loss, "device", _CPU), self.kept + 1)
        row = self._rows[self.kept]
        try:
            torch.stack((output.loss, output.grad_norm), out=row)
        except (RuntimeError, TypeError):  # a loss that requires grad, numbers (a train_step of
            # one's own), or a gradient norm on another device than the loss (a model split)
            torch.stack([torch.as_tensor(v).detach().to(row.device, torch.float32).reshape(())
                         for v in (output.loss, output.grad_norm)], out=row)
        self.kept += 1
        if output.logs:
            self.logs.append(output.logs)
        if output.spike is not None:
            self.spikes.append(output.spike)
        if output.loss_spike is not None:
            self.loss_spikes.append(output.loss_spike)
        self.batches.append(batches)

    def _grow(self, device: torch.device, steps: int) -> None:
        """Room for at least `steps` steps (twice as many as before; at least 128): the rows kept
        are copied over."""
        old = self._values
        self._values = torch.zeros(max(128, 2 * len(self._rows), steps), 2, device=device)
        if old is not None:
            self._values[:len(old)] = old
        self._rows = list(self._values.unbind())

    def catch_up(self) -> None:
        """Flag the steps kept since the last catch-up (with a `spike_flagger`): called by
        everything that reads the flags, and before a checkpoint takes the detectors' state."""
        if self.kept > self._flagged and self.spike_flagger is not None:
            spike, loss_spike = self.spike_flagger(self.values[self._flagged:])
            self.spikes.append(spike)
            self.loss_spikes.append(loss_spike)
        self._flagged = self.kept

    def state_dict(self) -> dict[str, Any]:
        """The values collected since the last log point (so a resumed run logs the same means)."""
        self.catch_up()
        # one (kept, 2) tensor: a tensor per step (saferun's earlier layout, still loaded) took
        # about 70 ms to save per 1000 steps kept, when log points are rarer than checkpoints
        return {"values": self.values.clone(),
                "logs": [dict(d) for d in self.logs], "batches": list(self.batches),
                "spikes": list(self.spikes), "loss_spikes": list(self.loss_spikes),
                "samples": self.samples, "skipped": self.skipped,
                "folded": self.folded.state_dict(), "media": [vars(m) for m in self.media]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.reset()
        values = state["values"] if "values" in state else _per_step_values(state)
        if len(values):
            self._values, self._rows = None, []
            self._grow(values.device, len(values))
            assert self._values is not None
            self._values[:len(values)] = values.float()
        self.kept = len(values)
        self.logs, self.batches = [dict(d) for d in state["logs"]], list(state["batches"])
        self.spikes, self.loss_spikes = list(state["spikes"]), list(state.get("loss_spikes", []))
        self._flagged = self.kept  # (saved after a catch-up: every kept step is flagged)
        self.samples, self.skipped = state["samples"], state["skipped"]
        self.folded.load_state_dict(state.get("folded", {}))  # (absent: saferun before self.log)
        self.media = [Media(**m) for m in state.get("media", [])]

    def read(self, extra: Mapping[str, torch.Tensor] = {}, totals: Mapping[str, torch.Tensor] = {},
             data: distributed.Ranks = distributed.Ranks()) -> dict[str, float]:
        """Means since the last reset, `extra` values and throughput; with several data ranks
        (`data`: the strategy's), means averaged and `totals` summed over them. One collective,
        one host read."""
        world_size = data.world_size
        keys = list(dict.fromkeys(k for d in self.logs for k in d))  # (each step's, in order)
        ranked = world_size > 1
        if ranked:  # a rank may not have logged a key: every rank reduces the same columns
            keys = distributed.union(keys, data.group)
        names, columns = [], []
        sums = dict(totals)
        if self.kept:
            names += ["train/loss", "train/grad_norm"]
            columns += [self.losses.mean(), self.grad_norms.mean()]
            reported = {k: [d[k].float() for d in self.logs if k in d] for k in keys}
            if not ranked:  # the mean over the steps that reported it
                names += [f"train/{k}" for k in keys]
                columns += [torch.stack(reported[k]).mean() for k in keys]
            else:  # its sum and count on every rank: the mean over the steps of all ranks
                zero = torch.zeros((), device=columns[0].device)
                for k in keys:
                    sums[f"train/{k}"] = torch.stack(reported[k]).sum() if reported[k] else zero
                    sums[f"count/{k}"] = torch.full((), float(len(reported[k])), device=zero.device)
        names += list(extra)
        columns += [v.detach().float() for v in extra.values()]
        averaged = len(columns)
        self.catch_up()
        if self.spikes:
            sums["train/spikes"] = _flags(self.spikes, self.kept).float().sum()
        if world_size > 1 and columns:  # samples from every rank, made on the device: no copy
            sums["samples"] = torch.full((), float(self.samples), device=columns[0].device)
        names += list(sums)
        columns += [v.float() for v in sums.values()]
        values: list[float] = []
        device = columns[0].device if columns else torch.device("cpu")
        folded = {f"train/{k}": v for k, v in self.folded.reduced(device, data.group).items()}
        if columns:
            stacked = distributed.all_reduce(torch.stack(columns), group=data.group)
            stacked[:averaged] /= world_size
            stacked = torch.cat([stacked, *[v.reshape(1) for v in folded.values()]])
            values = stacked.tolist()
        elif folded:
            values = torch.stack(list(folded.values())).tolist()
        names += list(folded)
        seconds = max(time.perf_counter() - self.started, 1e-9)
        metrics = dict(zip(names, values))
        for k in keys if ranked and self.kept else ():
            count = metrics.pop(f"count/{k}")
            metrics[f"train/{k}"] /= count  # > 0: some rank reported it
        samples = metrics.pop("samples", float(self.samples))
        metrics["perf/steps_per_sec"] = self.steps / seconds
        metrics["perf/samples_per_sec"] = samples / seconds
        if self.skipped:
            metrics["train/skipped_steps"] = float(self.skipped)
        return metrics

    def first_bad(self, check_nonfinite: bool = True, check_grads: bool = True,
                  ranks: distributed.Ranks = distributed.Ranks()) -> Optional[tuple[int, str, int]]:
        """(position in this window, "non-finite" or "spike", rank) of the first bad step, or None.

        Under torchrun: the first step bad on any rank, and the rank where it started. The
        gradient norm, averaged over ranks, is the same everywhere, so a rank whose own loss
        was non-finite or spiked comes first; then the lowest rank. One collective, one read.
        """
        losses = ~torch.isfinite(self.losses)
        grads = ~torch.isfinite(self.grad_norms) if check_grads else losses & False
        rows = [losses, grads] if check_nonfinite else [losses & False] * 2  # off: spikes only
        self.catch_up()
        if self.loss_spikes:
            rows.append(_flags(self.loss_spikes, self.kept))
        if self.spikes:
            rows.append(_flags(self.spikes, self.kept))
        # per (row, step): world_size - the lowest rank that flagged it (0: none), via max
        codes = distributed.all_reduce(torch.stack(rows).int() * (ranks.world_size - ranks.rank),
                                       op="max")
        found = [(step, row, code) for row, flags in enumerate(codes.tolist())  # the one read
                 for step, code in enumerate(flags) if code]
        if not found:
            return None
        step, row, code = min(found)  # earliest step; non-finite first, this rank's own first
        return step, "non-finite" if row < 2 else "spike", ranks.world_size - code


class WeightedMeans:
    """Per-key means over batches, weighted by batch size, summed on the device.

    Each key counts its own samples: a value reported by only some batches is the
    mean over those batches, not diluted by the others.
    """

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}

    def add(self, values: Mapping[str, torch.Tensor], n: int) -> None:
        for k, v in values.items():
            weighted = v.detach().float() * n
            if k in self.sums:
                self.sums[k] = self.sums[k] + weighted
                self.counts[k] += n
            else:
                self.sums[k], self.counts[k] = weighted, n

    def read(self, extra: Mapping[str, torch.Tensor] = {}, device: Optional[torch.device] = None,
             synced: Mapping[str, torch.Tensor] = {}, group: Any = None
             ) -> tuple[dict[str, float], dict[str, float]]:
        """(means and `synced`, sums of `extra`), over every rank's batches: one collective, one
        host read. `synced`: values already the same on every rank (computed metrics), read as is.
        `group`: the data-parallel ranks' (None: every rank).

        Under torchrun the ranks first agree on the keys (a rank may have seen none of
        some key's batches), so that every rank reduces the same columns.
        """
        keys = distributed.union(list(self.sums), group)
        clash = sorted(set(keys) & set(synced))  # the same on every rank: all raise, none hangs
        if clash:
            raise SaferunError(f"validation_step returns {clash}, which a metric of build_metrics() "
                               f"also reports: rename one of them.")
        if not keys and not extra and not synced:
            return {}, {}
        tensors = [*self.sums.values(), *extra.values(), *synced.values()]
        device = device or (tensors[0].device if tensors else torch.device("cpu"))
        zero = torch.zeros((), device=device)
        # The per-key sample counts ride along, made on the device (no host-to-device copy).
        columns = [self.sums.get(k, zero) for k in keys]
        columns += [torch.full((), float(self.counts.get(k, 0)), device=device) for k in keys]
        columns += [v.float() for v in extra.values()]
        reduced = distributed.all_reduce(torch.stack([c.to(device) for c in columns]), group=group) \
            if columns else torch.zeros(0, device=device)
        if synced:
            reduced = torch.cat([reduced, torch.stack([v.to(device) for v in synced.values()])])
        values = reduced.tolist()
        n, m = len(keys), len(columns)
        means = {k: total / count for k, total, count in zip(keys, values[:n], values[n:2 * n])
                 if count > 0}
        means.update(zip(synced, values[m:]))
        return means, dict(zip(extra, values[2 * n:m]))


def scalar_dict(out: object, where: str) -> dict[str, torch.Tensor]:
    """Check that `out` maps names to scalar tensors (or numbers); name the offender if not."""
    if not isinstance(out, Mapping):
        raise SaferunError(
            f"{where} must return a dict of scalar tensors, got {type(out).__name__}"
            f"{' (a missing return statement?)' if out is None else ''}. "
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


def _flags(parts: list[torch.Tensor], steps: int) -> torch.Tensor:
    """The spike flags of the kept `steps` as one 1-D tensor, from per-step flags and runs of
    them; steps before the guard was on (a resume that turned it on mid-window) are False."""
    flags = torch.stack(parts) if all(p.dim() == 0 for p in parts) else \
        torch.cat([p.reshape(-1) for p in parts])
    missing = steps - flags.numel()
    return flags if missing <= 0 else torch.cat(
        [torch.zeros(missing, dtype=torch.bool, device=flags.device), flags])


def _per_step_values(state: Mapping[str, Any]) -> torch.Tensor:
    """The (kept, 2) values of a checkpoint saved by saferun before they were one tensor: a
    0-dim tensor per step, in "losses" and "grad_norms" (each in its own dtype)."""
    losses, grad_norms = list(state["losses"]), list(state["grad_norms"])
    if not losses:
        return torch.zeros(0, 2)
    return torch.stack([torch.stack(losses).float(), torch.stack(grad_norms).float()], 1)
