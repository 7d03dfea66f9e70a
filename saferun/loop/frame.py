"""The step frame: `training_step` on one batch under the loop's contexts, for both step drivers.

    move the batch to the device -> the strategy's micro-batch context (DDP's no_sync and
    gradient average, FSDP's gradient sync) -> autocast -> the logbook and the habits
    (`self.log`, a refused optimizer.step) -> training_step -> autocast ends -> the driver's
    part after it (`then`: the single-optimizer step's loss check and backward) -> the
    micro-batch context ends; on an error, the failure record (phase "training", the batch)

The single-optimizer step (`Trainer._forward_backward`) and the several-optimizer step
(`ManualSteps.step`) both run it. The checks of the first steps are wrappers in the frame,
each dropped when done: the first-step checks around `training_step` (`first_steps`: the
habits' backward check, guards.model_audit's audits) and the FLOP count around a whole
micro-batch (`count_first_step`). One process in fp32 enters no context at all. After the
first steps the frame costs three Python calls per micro-batch beyond `training_step`: `run`,
`_training_step` and `Logbook.run` (plus the batch's move and `then`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional, Protocol

import torch

from .failure_site import record
from .habits import StepHabits
from .logbook import Logbook
from ..data.transfer import move_to_device


class FrameOwner(Protocol):
    """The public part of the Trainer the frame uses: its `training_step` (looked up at each
    call, so that a wrapper set on the instance, e.g. by saferun.testing, runs) and its state."""

    state: Any  # LoopState

    def training_step(self, batch: Any) -> Any: ...


class FirstStepCheck(Protocol):
    """A check of the first steps around the `training_step` call: runs `call(batch)` (the
    step's training_step, or the next check) and sets `done` when later steps need it no more."""

    done: bool

    def __call__(self, call: Callable[[Any], Any], batch: Any, step: int) -> Any: ...


class MicroBatchCount(Protocol):
    """Around whole micro-batches (training_step and backward) until `done`: the FLOP count."""

    done: bool

    def __call__(self, run: Callable[[], Any], last: bool) -> Any: ...


class StepFrame:
    """Runs `training_step` on one batch under the loop's contexts (see the module)."""

    def __init__(self, owner: FrameOwner, *, logbook: Logbook, habits: StepHabits, strategy: Any,
                 autocast: Callable[[], Any], device: torch.device, non_blocking: bool) -> None:
        """`strategy`: its `micro_batch(last)` context, entered only where it `wraps_micro_batch`;
        `autocast`: the precision's context factory (`contextlib.nullcontext` in fp32)."""
        self._owner, self._logbook, self.habits = owner, logbook, habits
        self.strategy, self._autocast = strategy, autocast
        self._device, self._non_blocking = device, non_blocking
        # one process in fp32: no context to enter (six Python calls per step fewer)
        self._plain = autocast is contextlib.nullcontext and not strategy.wraps_micro_batch
        self._first: list[FirstStepCheck] = []  # empty after the first steps
        self._count: Optional[MicroBatchCount] = None

    def first_steps(self, *checks: FirstStepCheck) -> None:
        """Run the next `training_step` calls inside `checks` (the first one outermost), each
        until it is done; replaces the checks an earlier fit() left."""
        self._first = list(reversed(checks))

    def count_first_step(self, count: Optional[MicroBatchCount]) -> None:
        """Run the next micro-batches inside `count` until it is done (None: none)."""
        self._count = count

    def run(self, batch: Any, last: bool = True,
            then: Optional[Callable[[Any, int], Any]] = None) -> Any:
        """`training_step(batch)` (with what it self.log()ged as means joined in), then
        `then(out, step)` (its result returned), for the step the loop is at; `last`: the
        step's last micro-batch (DDP averages the gradients after it)."""
        if self._count is not None:  # the first step's FLOPs
            return self._counted(batch, last, then)
        step = self._owner.state.step + 1
        batch = move_to_device(batch, self._device, self._non_blocking)
        try:  # the explanation of a failure learns the phase and the batch from here
            if self._plain:
                out = self._training_step(batch, step)
                return out if then is None else then(out, step)
            with self.strategy.micro_batch(last):
                with self._autocast():
                    out = self._training_step(batch, step)
                return out if then is None else then(out, step)
        except BaseException as exc:
            record(exc, phase="training", batch=batch)
            raise

    def _training_step(self, batch: Any, step: int) -> Any:
        habits = self.habits
        habits.step = step  # an optimizer.step() in training_step is refused
        try:
            return self._logbook.run("train", step, self._checked if self._first else
                                     self._owner.training_step, batch, "training_step")
        finally:
            habits.step = 0

    def _counted(self, batch: Any, last: bool, then: Optional[Callable[[Any, int], Any]]) -> Any:
        """`run` inside the FLOP count (until it is done)."""
        count, self._count = self._count, None
        assert count is not None
        try:
            return count(lambda: self.run(batch, last, then), last)
        finally:
            if not count.done:
                self._count = count

    def _checked(self, batch: Any) -> Any:
        """training_step inside the first steps' checks; those done drop out."""
        call: Callable[[Any], Any] = self._owner.training_step
        step = self._owner.state.step + 1
        for check in self._first:  # (innermost first)
            call = _bound(check, call, step)
        try:
            return call(batch)
        finally:
            self._first = [c for c in self._first if not c.done]


def _bound(check: FirstStepCheck, call: Callable[[Any], Any], step: int) -> Callable[[Any], Any]:
    return lambda batch: check(call, batch, step)


class FirstBackward:
    """The habits' one-off check (loop/habits.py): gradients that appear during the first
    `training_step` are the user's own backward. The single-optimizer step's (with several
    optimizers training_step runs the backwards, through `optimize`)."""

    def __init__(self, habits: StepHabits, params: list[torch.nn.Parameter]) -> None:
        self._habits, self._params = habits, params
        self.done = False

    def __call__(self, call: Callable[[Any], Any], batch: Any, step: int) -> Any:
        had_grads = self._habits.grads_before(self._params)
        out = call(batch)
        self.done = True
        self._habits.check_first_backward(self._params, had_grads, step)
        return out
