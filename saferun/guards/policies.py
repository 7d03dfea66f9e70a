"""The bad-step policies: what follows a step whose loss or gradients were not finite
(guards.nonfinite) or that spiked (guards.spikes). `BadStepPolicy` (badstep.py) finds the bad
step; the policy configured for its kind says what happens next, and the guard carries it out.

A new policy is one class here and its entry in `POLICIES` (whose names are the values
guards.nonfinite and guards.spikes accept).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol


@dataclass(frozen=True)
class BadStep:
    """A bad step a check found: `report` says what, where and on which samples."""

    step: int
    kind: str  # "non-finite" or "spike"
    report: str
    bad_input: bool  # the batch itself held NaN/Inf (no layer to blame, no replay)
    in_state: bool = False  # found at a save in the parameters, buffers or optimizer state


class Recovery(Protocol):
    """What a policy can ask of the guard that found the bad step."""

    def raise_bad(self, bad: BadStep) -> None: ...
    def roll_back(self, bad: BadStep) -> None: ...


class Policy:
    """A bad-step policy. By default a bad step raises: the check that found it stops the run,
    naming the step, its values and its samples."""

    name: ClassVar[str]
    checked: ClassVar[bool] = True  # bad steps of this kind are looked for at all
    # every step is asked at once (one host read per step) and a bad one's update dropped
    skips: ClassVar[bool] = False
    needs_checkpoint: ClassVar[bool] = False  # a checkpoint must exist before the first step

    def on_bad_window(self, guard: Recovery, bad: BadStep) -> None:
        """A check (log point, validation, save) found `bad` among the steps since the last."""
        guard.raise_bad(bad)


class Raise(Policy):
    """Stop the run at the check that finds a bad step (the default)."""

    name = "raise"


class Skip(Policy):
    """Drop the update of a bad step as it happens; the run goes on (guards.max_consecutive
    in a row raise). A bad step a check still finds (one the per-step test cannot see) raises."""

    name = "skip"
    skips = True


class Rollback(Policy):
    """Restore the newest checkpoint and go on with the data after the bad step."""

    name = "rollback"
    needs_checkpoint = True

    def on_bad_window(self, guard: Recovery, bad: BadStep) -> None:
        guard.roll_back(bad)


class Off(Policy):
    """Do not look for bad steps of this kind."""

    name = "off"
    checked = False


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (Raise, Skip, Rollback, Off)}
