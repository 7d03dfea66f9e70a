"""Exact resume as a test: stop a run at chosen points, resume it, compare with a straight run.

How a run is stopped: a real SIGTERM sent to this process from inside the Trainer's own
`training_step` (or `validation_step`) at the chosen step, wrapped on the instance. That is
the production path of a preemption (the handler sets a flag, the step finishes, the loop
saves that step boundary, or records the interrupted validation as owed, and raises
`Preempted`); the resumed run is a fresh Trainer with `resume=auto` on the same directory.
In-process rather than a killed subprocess because the point must be exact (a step, a
validation batch), because the user's Trainer need not be launchable as a script, and
because it saves an interpreter start and a torch import per run. What SIGKILL adds (an
atomic checkpoint, a torn save) does not depend on the user's code and is tested in
saferun's own suite. What in-process cannot see: state at module level in the user's
code, which survives from one run to the next here but not across a real restart.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from ..callbacks import Callback
from ..preemption import Preempted
from ..trainer import Trainer
from .jobs import Job, fail, one_thread, probe, work_dir

STOPS = ("mid-epoch", "epoch-end", "validation")
LOG_EVERY = 3

StopSpec = Union[str, tuple[str, int]]


@dataclass(frozen=True)
class Stop:
    """A SIGTERM during training step `step` ("training"), or during the validation after
    step `step` ("validation")."""

    where: str
    step: int
    label: str

    def __str__(self) -> str:
        during = f"step {self.step}" if self.where == "training" else f"the validation after step {self.step}"
        return f"a SIGTERM during {during} ({self.label})"


class Curves(Callback):
    """The logged curves as callbacks see them: train/loss at log points, validation metrics."""

    def __init__(self) -> None:
        self.train: list[tuple[int, float]] = []
        self.val: list[tuple[int, dict[str, float]]] = []

    def on_log(self, view: Any, metrics: Mapping[str, float]) -> None:
        if "train/loss" in metrics:
            self.train.append((view.step, metrics["train/loss"]))

    def on_validation_end(self, view: Any, metrics: Mapping[str, float]) -> None:
        self.val.append((view.step, dict(metrics)))


def assert_resumes_exactly(job: Job, stops: Optional[Sequence[StopSpec]] = None, *,
                           max_steps: Optional[int] = None, max_epoch_steps: int = 60,
                           tmp_dir: Any = None) -> None:
    """Stopped at each of `stops` and resumed, the run ends bitwise equal to a straight run.

    Compared: parameters and buffers, optimizer and scheduler state, the step, and the
    logged curves (train/loss at log points, every validation metric).

    Args:
        job: from `saferun.testing.recipe` or `saferun.testing.trainer`.
        stops: "mid-epoch" (during the middle step of the first epoch), "epoch-end" (during
            its last step, where no validation is due), "validation" (during the validation
            after the first step of the second epoch), or ("training", N) / ("validation", N).
            Default: the three named ones ("validation" only if the job has a validation set).
        max_steps: the straight run's length; default: one epoch plus 3 steps. Validation
            runs every (epoch + 1) steps and at the end (2 batches: `limit_val_batches`),
            metrics are logged every 3 steps.
        max_epoch_steps: refuse an epoch longer than this (the straight run crosses one:
            shrink the data or raise the batch size in the job's config).
        tmp_dir: where the runs go (kept); default: a temporary directory.
    """
    with one_thread(), work_dir(tmp_dir, "saferun-resume-") as tmp:
        per_epoch, validates = probe(job, job.short(tmp / "probe", max_epochs=None))
        if stops is None:
            stops = [s for s in STOPS if validates or s != "validation"]
        planned = _plan(job, stops, per_epoch, validates, max_epoch_steps)
        total = max_steps or (per_epoch or 0) + 3
        if not total or any(s.step > total for s in planned):
            fail(f"exact resume: give max_steps (the straight run's length) covering the stops "
                 f"{[str(s) for s in planned]}.")
        settings: dict[str, Any] = dict(max_steps=total, max_epochs=None, log_every_n_steps=LOG_EVERY,
                        val_every_n_steps=(per_epoch or total) + 1, limit_val_batches=2)
        straight_curves = Curves()
        straight = job.build(job.short(tmp / "straight", **settings), [straight_curves])
        straight.fit()
        want = _final_state(straight, straight_curves)
        for stop in planned:
            curves = Curves()
            stopped = job.build(job.short(tmp / stop.label, **settings), [curves])
            _plant_sigterm(stopped, stop)
            try:
                stopped.fit()
            except Preempted:
                pass
            else:
                fail(f"exact resume: {stop} never happened (the run ended at step "
                     f"{stopped.state.step} of {total}).")
            if stopped.state.step != stop.step:
                fail(f"exact resume: {stop} saved step {stopped.state.step}, not {stop.step}.")
            resumed = job.build(job.short(tmp / stop.label, resume="auto", **settings), [curves])
            resumed.fit()
            differences = state_differences(_final_state(resumed, curves), want)
            if differences:
                fail(_message(job, stop, total, differences))


def _plan(job: Job, stops: Sequence[StopSpec], per_epoch: Optional[int], validates: bool,
          max_epoch_steps: int) -> list[Stop]:
    """The stops as (where, step); named ones need the epoch's length."""
    planned = []
    for spec in stops:
        if isinstance(spec, tuple):
            where, step = spec
            if where not in ("training", "validation"):
                raise ValueError(f"a stop is ('training', N) or ('validation', N), not {spec!r}")
            planned.append(Stop(where, int(step), f"{where}-{step}"))
            continue
        if spec not in STOPS:
            raise ValueError(f"unknown stop {spec!r}: one of {', '.join(STOPS)} or ('training', N)")
        if per_epoch is None:
            fail(f"exact resume: the training data has no length, so {spec!r} has no step; "
                 f"give the stops as ('training', N) or ('validation', N), with max_steps.")
        assert per_epoch is not None
        if per_epoch > max_epoch_steps:
            fail(f"exact resume: an epoch of {job.name} is {per_epoch} steps, more than "
                 f"max_epoch_steps={max_epoch_steps}: the straight run would cross one. Make "
                 f"the test's data smaller or its batches larger (config overrides), raise "
                 f"max_epoch_steps, or give the stops as ('training', N).")
        if spec == "mid-epoch" and per_epoch < 3:
            fail(f"exact resume: an epoch of {job.name} is {per_epoch} steps: no mid-epoch step.")
        if spec == "validation" and not validates:
            fail(f"exact resume: {job.name} has no validation set: drop 'validation' from stops.")
        step = {"mid-epoch": per_epoch // 2, "epoch-end": per_epoch, "validation": per_epoch + 1}[spec]
        planned.append(Stop("validation" if spec == "validation" else "training", step, spec))
    return planned


def _plant_sigterm(trainer: Trainer, stop: Stop) -> None:
    """Wrap the instance's training_step or validation_step to send SIGTERM at `stop`."""
    name = "training_step" if stop.where == "training" else "validation_step"
    original = getattr(trainer, name)
    pending = [True]

    def planted(batch: Any) -> Any:
        step = trainer.state.step + 1 if stop.where == "training" else trainer.state.step
        if pending[0] and step == stop.step:
            pending[0] = False
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal: the handler saferun installed
        return original(batch)

    setattr(trainer, name, planted)


def _final_state(trainer: Trainer, curves: Curves) -> dict[str, Any]:
    return {"step": trainer.state.step, "model": trainer.model.state_dict(),
            "optimizer": trainer.optimizer.state_dict(),
            "scheduler": trainer.scheduler.state_dict() if trainer.scheduler is not None else None,
            "train curve": curves.train, "validation curve": curves.val}


def state_differences(got: Any, want: Any, path: str = "") -> list[str]:
    """Where `got` and `want` differ, one line each: tensors bitwise (dtype, shape, values),
    containers key by key, everything else by ==."""
    if isinstance(want, torch.Tensor) or isinstance(got, torch.Tensor):
        return [] if _same_tensor(got, want) else [f"{path}: {_tensor_diff(got, want)}"]
    if isinstance(want, Mapping) and isinstance(got, Mapping):
        if list(got) != list(want):
            return [f"{path or 'keys'}: keys {sorted(map(str, got))} != {sorted(map(str, want))}"]
        return [d for k in want for d in state_differences(got[k], want[k], f"{path}.{k}".lstrip("."))]
    if isinstance(want, (list, tuple)) and isinstance(got, (list, tuple)):
        if len(got) != len(want):
            return [f"{path}: {len(got)} entries, expected {len(want)}: {_short(got)} != {_short(want)}"]
        return [d for i, (g, w) in enumerate(zip(got, want))
                for d in state_differences(g, w, f"{path}[{i}]")]
    return [] if got == want else [f"{path}: {_short(got)} != {_short(want)} (uninterrupted)"]


def _same_tensor(a: Any, b: Any) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
            and a.shape == b.shape and bool(torch.equal(a, b)))


def _tensor_diff(a: Any, b: Any) -> str:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return f"{_short(a)} != {_short(b)}"
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"
    differ = a.ne(b)
    diff = (a.double() - b.double()).abs().max().item() if a.is_floating_point() else None
    return (f"{int(differ.sum())} of {a.numel()} values differ" +
            (f" (max abs diff {diff:.3g})" if diff is not None else ""))


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _message(job: Job, stop: Stop, total: int, differences: list[str]) -> str:
    shown = differences[:12] + ([f"... and {len(differences) - 12} more"] if len(differences) > 12 else [])
    return "\n".join([
        f"exact resume failed for {job.name}: stopped by {stop}, then resumed with resume=auto, "
        f"the {total}-step run ends differently from the uninterrupted one:",
        *("  " + d for d in shown),
        "Usual causes: randomness saferun does not checkpoint (a torch.Generator, "
        "np.random.Generator or random.Random object kept on the dataset, sampler or Trainer; "
        "module-level state), or state the Trainer, dataset or a callback keeps outside its "
        "state_dict (a counter, a cache, a curriculum position).",
    ])
