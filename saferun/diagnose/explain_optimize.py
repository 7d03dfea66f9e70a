"""Where in the step an explanation says a failure happened (diagnose/explain.py): which
`self.optimize(name, loss)` call raised (or, with trainer.accumulate, which micro-batch), read
from what the loop's call sites recorded; and, with several optimizers, a replay of
training_step in which optimize() updates nothing (loop/manual.py `ManualSteps.replaying`)."""

from __future__ import annotations

import contextlib
from typing import Any

from ..loop.failure_site import site_of


def replaying(steps: Any, backward: bool) -> Any:
    """Several optimizers (`steps`: the ManualSteps, else None): the replay's optimize() calls
    step no optimizer, scheduler or scaler (`backward`: they run the backward only, for the
    in-place trace)."""
    return steps.replaying(backward) if steps is not None else contextlib.nullcontext()


def in_step(exc: BaseException) -> str:
    """Where in the step `exc` was raised, as the loop's call sites recorded it: ", in
    self.optimize(...)" (see `in_optimize`), or " (micro-batch 3 of 3)" under
    trainer.accumulate, else ""."""
    site = site_of(exc)
    if site is not None and site.micro_batch is not None:
        index, count = site.micro_batch
        return f" (micro-batch {index + 1} of {count})"
    return in_optimize(exc)


def in_optimize(exc: BaseException) -> str:
    """", in self.optimize('gen', loss) (the backward of its loss)" when an optimize() call
    raised `exc`, else ""."""
    site = site_of(exc)
    if site is None or site.optimizer is None:
        return ""
    part = _PARTS.get(site.optimize_part or "", "")
    return f", in self.optimize({site.optimizer!r}, loss){part}"


_PARTS = {"backward": " (the backward of its loss)", "step": " (its optimizer's step)"}
