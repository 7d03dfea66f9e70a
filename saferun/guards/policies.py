"""The bad-step policies: what follows a step whose loss or gradients were not finite
(guards.nonfinite) or that spiked (guards.spikes). `BadStepPolicy` (badstep.py) finds the bad
step; the policy configured for its kind returns a `Verdict`, and the loop (the Trainer)
applies it: it raises the guard's error, or rolls back through the Checkpointer.

A new policy is one class here and its entry in `POLICIES` (whose names are the values
guards.nonfinite and guards.spikes accept).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class BadStep:
    """A bad step a check found: `report` says what, where and on which samples."""

    step: int
    kind: str  # "non-finite" or "spike"
    report: str
    bad_input: bool  # the batch itself held NaN/Inf (no layer to blame, no replay)
    in_state: bool = False  # found at a save in the parameters, buffers or optimizer state


class Verdict(enum.Enum):
    """What a policy says follows a bad step a check found; the loop applies it."""

    RAISE = "raise"  # stop the run with the guard's error (what, where, what to do)
    ROLL_BACK = "roll back"  # restore the newest clean checkpoint, go on with the data after it


class Policy:
    """A bad-step policy. By default a bad step raises: the check that found it stops the run,
    naming the step, its values and its samples."""

    name: ClassVar[str]
    checked: ClassVar[bool] = True  # bad steps of this kind are looked for at all
    # every step is asked at once (one host read per step) and a bad one's update dropped
    skips: ClassVar[bool] = False
    needs_checkpoint: ClassVar[bool] = False  # a checkpoint must exist before the first step
    # the run goes on without some steps' updates (skipped or rolled back): which steps are bad
    # decides the result, so a resume must find the same ones (checkpoint/compat.py)
    drops_steps: ClassVar[bool] = False

    def on_bad_window(self, bad: BadStep) -> Verdict:
        """A check (log point, validation, save) found `bad` among the steps since the last."""
        return Verdict.RAISE


class Raise(Policy):
    """Stop the run at the check that finds a bad step (the default)."""

    name = "raise"


class Skip(Policy):
    """Drop the update of a bad step as it happens; the run goes on (guards.max_consecutive
    in a row raise). A bad step a check still finds (one the per-step test cannot see) raises."""

    name = "skip"
    skips = True
    drops_steps = True


class Rollback(Policy):
    """Restore the newest checkpoint and go on with the data after the bad step."""

    name = "rollback"
    needs_checkpoint = True
    drops_steps = True

    def on_bad_window(self, bad: BadStep) -> Verdict:
        return Verdict.ROLL_BACK


class Off(Policy):
    """Do not look for bad steps of this kind."""

    name = "off"
    checked = False


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (Raise, Skip, Rollback, Off)}
