"""The bad-step policy: one object the loop asks "is this window good, and what now?".

guards.nonfinite (raise / skip / rollback / off) and guards.spikes (raise / skip / rollback /
off), with guards.max_consecutive and guards.anomaly_replay. Under a skip policy the step asks
`bad_now` (one host sync per step; `loop/update.py` then drops the update) and the step ends
with `skipped`; otherwise the loop checks the window since the last check at log points
(`log_point_bad`), validations and before saves (`window_bad`), with no host sync per step.
Before a save the loop also checks what it would write (`state_bad`: the parameters, buffers
and optimizer state, one host read per save), so that no checkpoint holds a non-finite value:
an update can make them so under a finite loss.

A check returns the bad step it found (a `BadStep`, or None); the policy of its kind gives the
`verdict`, and the loop applies it: it raises `error(bad)`, or rolls back through the
Checkpointer (`rolling_back`, `unclean`, `rolled_back` say what the guard owns of that: the
count, the check of each checkpoint, the report). The guard is handed what it works with: the
log window's running metrics, the training loader (a bad batch's inputs are looked at) and the
run's newest checkpoint as the Checkpointer names it (`newest`); of the Trainer it reads only
public state (`LoopOwner`). Everything else it owns (the spike detector, the buffer snapshot,
the counters).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Protocol

import torch

from ..callbacks import StepOutput
from ..errors import NonFiniteError
from ..text import short
from .. import distributed
from .buffers import BufferSnapshot
from .batchinfo import nonfinite_inputs
from .replay import first_nonfinite
from .policies import POLICIES, BadStep, Verdict
from .spikes import SpikeDetector

log = logging.getLogger("saferun")


class LoopOwner(Protocol):
    """The public part of the Trainer the policy uses (a Protocol: guards do not import the
    trainer, so there is no import cycle)."""

    cfg: Any
    model: torch.nn.Module
    optimizer: Any  # an Optimizer, or several by name
    state: Any  # LoopState
    ranks: distributed.Ranks


class BadStepPolicy:
    """Detects bad steps (non-finite values, spikes) and applies the configured policy."""

    def __init__(self, trainer: LoopOwner, running: Any, loader: Any,
                 newest: Callable[[], Optional[tuple[Path, int]]]) -> None:
        """`running`: the log window's metrics (RunningTrainMetrics), which the checks read;
        `loader`: the training DataLoader (a bad batch's inputs are looked at); `newest`: the
        run's newest checkpoint and its step, or None (`Checkpointer.newest`), which the errors
        name."""
        t, g = trainer.cfg.trainer, trainer.cfg.guards
        self._trainer = trainer
        self._running, self._loader, self._newest = running, loader, newest
        self._g = g
        # fp16: a non-finite gradient is the GradScaler's normal signal to skip a step.
        self.grads_checked = t.precision != "fp16"
        # what follows a bad step of each kind (guards/policies.py)
        self.nonfinite_policy = POLICIES[g.nonfinite]()
        self.spike_policy = POLICIES[g.spikes]()
        self.skip_nonfinite = self.nonfinite_policy.skips  # fp16: a non-finite loss (a bad batch)
        self.skip_spikes = self.spike_policy.skips
        self.skips = self.skip_nonfinite or self.skip_spikes
        # a rollback needs a checkpoint to go back to, an anomaly replay one to replay from
        self.needs_checkpoint = (self.nonfinite_policy.needs_checkpoint
                                 or self.spike_policy.needs_checkpoint or g.anomaly_replay)
        # A skipped step must also undo what its forward wrote into buffers (BatchNorm statistics).
        self.snapshot = BufferSnapshot(trainer.model) if self.skips else None
        self.rolled_back_from = 0  # the bad step of this process's latest rollback (0: none)
        self.spikes: Optional[SpikeDetector] = None
        if self.spike_policy.checked:
            # Each step is compared with a limit on the device; the statistics behind it are
            # refreshed every log interval, and at least four times per window. The loss and
            # the gradient norm are two series of one detector: one set of operators for both.
            every = max(1, min(t.log_every_n_steps, g.spike_window // 4))
            self.spikes = SpikeDetector(g.spike_window, g.spike_threshold, g.spike_warmup,
                                        refresh_every=every, series=("loss", "grad_norm"))
        # A skip policy decides at each step, so it needs each step's flag then; raise and
        # rollback act at log points and saves, so the steps are compared there, all at once
        # (`flag_steps`): no operator per step.
        self.spikes_each_step = self.spikes is not None and self.skips
        self._rollbacks = 0
        self._skips_in_a_row, self._last_skipped = 0, -1
        self._checked: set[str] = set()  # the checkpoints this process checked finite at save

    # ------------------------------------------------------------------ per step (hot path)

    def spike(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the loss or the gradient norm spiked, the loss spiked), on the device."""
        assert self.spikes is not None
        flags = self.spikes.update(torch.stack([loss, grad_norm]))
        return flags.any(), flags[0]

    def flag_steps(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`spike` for several steps in order, at once (the log window's catch-up when no skip
        policy is on, `RunningTrainMetrics.catch_up`): `values` holds a (loss, gradient norm)
        row per step; 1-D flags, the same as step by step."""
        assert self.spikes is not None
        flags = self.spikes.update_many(values)  # (a row per step: one per series, in order)
        return flags.any(1), flags.select(1, 0)

    def bad_now(self, loss: torch.Tensor, grad_norm: torch.Tensor,
                spike: Optional[torch.Tensor]) -> bool:
        """For the skip policies: is this step bad? Reads one value from the device."""
        bad = torch.zeros((), dtype=torch.bool, device=loss.device)
        if self.skip_nonfinite:
            # NaN and Inf survive the sum; under fp16 the GradScaler handles the gradients
            bad |= ~torch.isfinite(loss + grad_norm if self.grads_checked else loss)
        if self.skip_spikes and spike is not None:
            bad |= spike
        return bool(distributed.all_reduce(bad.int()))  # under torchrun: bad on any rank

    def skipped(self, loss: torch.Tensor, grad_norm: torch.Tensor, samples: int) -> StepOutput:
        """A skip policy dropped this step's update (`loop/update.py`): parameters, optimizer
        and scheduler stay as before the step (the GradScaler, which saw the gradients, updated
        its scale as usual); the buffers go back too."""
        self.end_skipped_step(samples, "non-finite loss or gradients, or a spike; the update was "
                                       "skipped")
        return StepOutput(loss=loss, grad_norm=grad_norm, num_samples=samples, skipped=True)

    def end_skipped_step(self, samples: int, what: str) -> None:
        """The end of a step whose update a skip policy dropped (with several optimizers, the
        updates of some; `loop/manual.py` calls it): the buffers go back to before the step (the
        bad batch's BatchNorm statistics too), the step is counted, and `what` said. Too many
        in a row raise."""
        assert self.snapshot is not None
        self.snapshot.restore()
        step = self._trainer.state.advance(samples)
        self._skips_in_a_row = self._skips_in_a_row + 1 if self._last_skipped == step - 1 else 1
        self._last_skipped = step
        log.warning("step %d: %s (%d in a row).", step, what, self._skips_in_a_row)
        if self._skips_in_a_row >= self._g.max_consecutive:
            raise NonFiniteError(
                f"{self._skips_in_a_row} steps in a row ({step - self._skips_in_a_row + 1} to "
                f"{step}) had non-finite loss or gradients (or spiked) and were skipped "
                f"(guards.max_consecutive={self._g.max_consecutive}). Training is not "
                f"recovering: lower optim.lr, set trainer.max_grad_norm, or check the data.")

    # ------------------------------------------------------------------ at checks

    def log_point_good(self, metrics: Mapping[str, float]) -> bool:
        """Are a log point's metrics free of non-finite values and of flagged spikes?"""
        keys = ("train/loss", "train/param_norm") + (("train/grad_norm",) if self.grads_checked else ())
        if self.nonfinite_policy.checked and not all(
                math.isfinite(metrics[k]) for k in keys if k in metrics):
            return False
        return metrics.get("train/spikes", 0.0) == 0.0 or self.spike_policy.skips

    def clean_log_point(self) -> None:
        """A good log point: rollbacks since the last one no longer count as consecutive."""
        self._rollbacks = 0

    def window_bad(self) -> Optional[BadStep]:
        """Check the steps since the last log point (one host sync) and, with
        guards.check_params, the parameters (one more): the bad step found, or None."""
        g, tr = self._g, self._trainer
        # A save between log points must not write a non-finite parameter either.
        if g.check_params and first_nonfinite(tr.model.named_parameters()) is not None:
            return self.find_bad()  # (raises if the window's steps were good)
        spikes_at_checks = self.spike_policy.checked and not self.spike_policy.skips
        if not (self.nonfinite_policy.checked or spikes_at_checks) or not self._running.kept:
            return None
        if self._running.first_bad(self.nonfinite_policy.checked, self.grads_checked, tr.ranks) is None:
            return None
        return self.find_bad()

    def log_point_bad(self, metrics: Mapping[str, float]) -> Optional[BadStep]:
        """A log point's check: the bad step among its steps, or None (`log_point_good`)."""
        return None if self.log_point_good(metrics) else self.find_bad()

    def state_bad(self, path: Path) -> Optional[BadStep]:
        """Before a save of checkpoint `path`, after `window_bad`: are the parameters, buffers
        and optimizer state finite (each rank its own shards, the verdict agreed)? One host
        read. None if so; else the bad state, which nothing is saved of."""
        if not self.nonfinite_policy.checked:
            return None
        tr = self._trainer
        bad = nonfinite_state(tr.model, tr.optimizer)
        if distributed.on_every_rank(bad is None):
            self._checked.add(str(path.resolve()))
            return None
        on = f"rank {tr.ranks.rank}: " if tr.ranks.world_size > 1 else ""
        found = distributed.union([on + bad] if bad else [])  # every rank's, on every rank
        step = tr.state.step
        report = (f"the parameters, buffers or optimizer state are not finite at step {step}, "
                  f"where a checkpoint was due: {'; '.join(found)}. The losses and gradients "
                  f"checked before were finite, so an update made them so (a learning rate too "
                  f"large, an overflow in the optimizer, code that writes into the weights). "
                  f"Nothing was saved at step {step} ({path.name}; at the run's end also "
                  f"model.pt): a checkpoint never holds a non-finite value.")
        return BadStep(step, "non-finite", report, False, True)

    def verdict(self, bad: BadStep) -> Verdict:
        """What the policy of `bad`'s kind says follows it (the loop applies it)."""
        policy = self.nonfinite_policy if bad.kind == "non-finite" else self.spike_policy
        return policy.on_bad_window(bad)

    def replays(self, bad: BadStep) -> bool:
        """Does `bad`'s error come with an anomaly replay (guards.anomaly_replay)?"""
        return (self._g.anomaly_replay and bad.kind == "non-finite" and not bad.bad_input
                and not bad.in_state)

    def _checkpoints_said(self, bad_step: int) -> str:
        """What the newest checkpoint is to this failure: where to go on from, and whether it
        was checked finite (never a claim the files do not bear out)."""
        found = self._newest()
        if found is None:
            return "There is no checkpoint yet."
        newest, step = found
        when = (f"saved before step {bad_step}" if step < bad_step else
                f"saved at step {step}, after the bad step {bad_step} (its values were checked)")
        checked = ("checked finite when saved (parameters, buffers, optimizer state)"
                   if str(newest.resolve()) in self._checked else
                   "saved before this process started (a saferun save checks it unless "
                   "guards.nonfinite=off)")
        return f"The newest checkpoint, {newest}, was {when} and {checked}: resume={newest} continues from it."

    def find_bad(self) -> BadStep:
        """The first bad step since the last log point (non-finite or a spike), described:
        what, where, on which samples; every rank takes part."""
        tr, g = self._trainer, self._g
        running = self._running
        found = (running.first_bad(self.nonfinite_policy.checked, self.grads_checked, tr.ranks)
                 if running.kept else None)
        if found is None:  # the losses and gradients were finite: guards.check_params fired
            raise NonFiniteError(
                f"the parameters are not finite at step {tr.state.step}: "
                f"{first_nonfinite(tr.model.named_parameters())}. Lower optim.lr or set "
                f"trainer.max_grad_norm; set guards.anomaly_replay=true to find the operation.")
        first, kind, rank = found
        bad_step = tr.state.step - running.steps + 1 + first
        # the values and samples of the rank where it started, on every rank (torchrun)
        # which of the step's logged values were not finite (several optimizers: loss/<name>)
        logs = running.logs[first] if len(running.logs) == running.kept else {}
        mine = ([*running.values[first].tolist(),
                 running.batches[first], [k for k, v in logs.items() if not math.isfinite(v)]]
                if rank == tr.ranks.rank else None)
        loss, norm, where, bad_logs = distributed.broadcast(mine, src=rank)
        on_rank = f" on rank {rank}" if tr.ranks.world_size > 1 else ""
        indices = [i for micro in (where[1] if where else ()) for i in (micro or ())]
        samples = (f"epoch {where[0]}, sample indices {short(indices)}" if indices
                   else "sample indices unknown (a custom DataLoader)")
        what = "non-finite values" if kind == "non-finite" else (
            f"a loss spike or gradient explosion (guards.spikes, threshold "
            f"{g.spike_threshold} robust sigmas over {g.spike_window} steps)")
        named = f" (not finite: {', '.join(f'train/{k}' for k in bad_logs)})" if bad_logs else ""
        report = (f"{what} at step {bad_step}{on_rank}: loss {loss}, gradient norm "
                  f"{norm}{named}; {samples}.")
        # checked first: a NaN already in the data is not a layer's fault
        bad_input = nonfinite_inputs(self._loader, indices) if kind == "non-finite" else ""
        if bad_input:
            report = f"{what} at step {bad_step}{on_rank}: {bad_input} Loss {loss}, gradient " \
                     f"norm {norm}; {samples}."
        return BadStep(bad_step, kind, report, bool(bad_input))

    def error(self, bad: BadStep, replayed: str = "") -> NonFiniteError:
        """The raise verdict's error (a bad step a skip policy could not drop too): what, where,
        what to do; `replayed`: the anomaly replay's report (`replays`), or ""."""
        key = "guards.nonfinite" if bad.kind == "non-finite" else "guards.spikes"
        said = self._checkpoints_said(bad.step)
        if bad.in_state:
            return NonFiniteError(
                f"{bad.report} {said} What to do: lower optim.lr or set trainer.max_grad_norm; "
                f"look for code that writes into the weights or the optimizer state; or set "
                f"{key}=rollback to go back to the newest clean checkpoint and train on.")
        replayed = f"\n{replayed}" if replayed else ""
        return NonFiniteError(
            f"{bad.report} The check runs at log points, validations and saves (no host sync per "
            f"step), so that update and any after it were applied. {said} What to do: inspect "
            f"those samples; lower optim.lr or set "
            f"trainer.max_grad_norm; set guards.anomaly_replay=true to name the operation that "
            f"produced a NaN; or set {key}=skip or {key}=rollback to train past such "
            f"steps.{replayed}")

    # ------------------------------------------------------------------ recovery

    def rolling_back(self, bad: BadStep) -> None:
        """The rollback verdict, before the loop applies it: counted; too many without a clean
        log point in between raise."""
        self._rollbacks += 1
        if self._rollbacks > self._g.max_consecutive:
            raise NonFiniteError(
                f"{bad.report} Cannot roll back: {self._rollbacks} rollbacks without a clean log point "
                f"in between (guards.max_consecutive={self._g.max_consecutive}). Lower optim.lr, "
                f"set trainer.max_grad_norm, or check the data.")

    def unclean(self) -> Optional[str]:
        """A rollback's check of the checkpoint it just restored: None when every rank's
        parameters, buffers and optimizer state are finite, else what is not (one saved without
        the check, by an earlier saferun or with guards.nonfinite=off, may not be)."""
        tr = self._trainer
        bad = nonfinite_state(tr.model, tr.optimizer)
        return None if distributed.on_every_rank(bad is None) else (bad or "on another rank")

    def rolled_back(self, bad: BadStep, path: Optional[Path], skipped: list[str]) -> None:
        """The rollback applied: to checkpoint `path`, the newest clean one, said; None (none
        was clean: `skipped` says why each was not) raises."""
        if path is None:
            why = f" ({'; '.join(skipped)})" if skipped else ""
            raise NonFiniteError(f"{bad.report} Cannot roll back: there is no clean checkpoint to "
                                 f"roll back to{why}. Lower optim.lr, set trainer.max_grad_norm, "
                                 f"or check the data.")
        self.rolled_back_from = bad.step
        passed = f"; skipped, newer but not clean: {', '.join(skipped)}" if skipped else ""
        log.warning("%s Rolled back to %s (step %d), the newest clean checkpoint%s; the run "
                    "goes on with the data after step %d (the batches up to it are not trained "
                    "on again), if it has steps left.", bad.report, path,
                    self._trainer.state.step, passed, bad.step)


def nonfinite_state(model: torch.nn.Module, optimizer: Any) -> Optional[str]:
    """The first parameter, floating-point buffer or optimizer state tensor holding a NaN or
    Inf, named, or None: one host read (`first_nonfinite`). Sharded (FSDP), this rank's own
    shards; a GradScaler's state is not looked at (an inf there is its normal signal)."""
    names = {id(p): n for n, p in model.named_parameters()}
    tensors: list[tuple[str, torch.Tensor]] = [(f"parameter {n}", p) for n, p in model.named_parameters()]
    tensors += [(f"buffer {n}", b) for n, b in model.named_buffers() if b.is_floating_point()]
    several = isinstance(optimizer, Mapping)  # several optimizers by name
    for name, opt in (optimizer.items() if several else [("", optimizer)]):
        which = f"optimizer {name!r}" if several else "optimizer"
        for param, values in opt.state.items():
            tensors += [(f"{which} state {key} of {names.get(id(param), '?')}", v)
                        for key, v in values.items()
                        if isinstance(v, torch.Tensor) and v.is_floating_point()]
    return first_nonfinite((n, t.to_local() if hasattr(t, "to_local") else t) for n, t in tensors)
