"""guards.unused_params: name trainable parameters that got no gradient in the first step."""

from __future__ import annotations

import logging
from typing import Iterable, Optional

from torch import nn

from ..loop.steps import short

log = logging.getLogger("saferun")


def report_unused_parameters(named: Iterable[tuple[str, nn.Parameter]],
                             optimizer: Optional[str] = None) -> bool:
    """After the first backward: warn naming the trainable parameters of `named` that got no
    gradient; `optimizer`: with several optimizers, the one whose loss gave none. Returns
    False (nothing left to check), for the caller's pending flag."""
    unused = [n for n, p in named if p.requires_grad and p.grad is None]
    if unused and optimizer is None:
        log.warning(
            "%d trainable parameter(s) received no gradient in the first step: %s. "
            "training_step's loss does not depend on them; if that is intended, freeze them "
            "(trainer.frozen_modules) so that weight decay does not move them, and note that "
            "DistributedDataParallel needs find_unused_parameters=True for them.",
            len(unused), short(unused))
    elif unused:
        log.warning("%d parameter(s) of optimizer %r received no gradient from its loss in "
                    "the first step: %s. Its loss does not depend on them; freeze them or "
                    "move them to the optimizer whose loss trains them.", len(unused), optimizer,
                    short(unused))
    return False
