"""guards.unused_params: name trainable parameters that got no gradient in any step of a window.

Under routing (a mixture of experts sends no token to some expert on some step) or layer drop,
a parameter without a gradient on one step is normal; one that gets none on any of the first
`WINDOW` steps is not trained by this loss. Each step checks only the parameters still
waiting for a gradient: after the first step of a model that uses all its parameters, none.
"""

from __future__ import annotations

import logging
from typing import Iterable, Optional

from torch import nn

from ..text import short

log = logging.getLogger("saferun")

WINDOW = 20  # steps


class UnusedParameters:
    """The trainable parameters of `named` that have not had a gradient yet, reported once if
    they get none in `window` steps; `optimizer`: with several optimizers, the one whose loss
    gave none."""

    def __init__(self, named: Iterable[tuple[str, nn.Parameter]], window: int = WINDOW,
                 optimizer: Optional[str] = None) -> None:
        self.waiting = {n: p for n, p in named if p.requires_grad}
        self.window, self.seen, self.optimizer = max(window, 1), 0, optimizer

    def after_backward(self, step: int = 0) -> bool:
        """After a step's backward (a step guard, guards/step_guards.py): drop the parameters
        that got a gradient; report those left at the window's end. Returns whether the guard
        is done (nothing left to check, or the window is over)."""
        self.waiting = {n: p for n, p in self.waiting.items() if p.grad is None}
        self.seen += 1
        if self.waiting and self.seen >= self.window:
            self._report()
        return not self.waiting or self.seen >= self.window

    def _report(self) -> None:
        unused = list(self.waiting)
        steps = "the first step" if self.seen == 1 else f"any of the first {self.seen} steps"
        if self.optimizer is None:
            log.warning(
                "%d trainable parameter(s) received no gradient in %s: %s. training_step's loss "
                "does not depend on them; if they are never meant to train, freeze them "
                "(trainer.frozen_modules) so that weight decay does not move them, and note "
                "that DistributedDataParallel needs find_unused_parameters=True for them.",
                len(unused), steps, short(unused))
        else:
            log.warning("%d parameter(s) of optimizer %r received no gradient from its loss in "
                        "%s: %s. Its loss does not depend on them; if they are never meant to "
                        "train, freeze them or move them to the optimizer whose loss trains them.",
                        len(unused), self.optimizer, steps, short(unused))


def window(max_steps: Optional[int], step: int) -> int:
    """The steps the guard watches: WINDOW, or the steps the run has left if fewer."""
    return WINDOW if max_steps is None else max(1, min(WINDOW, max_steps - step))
