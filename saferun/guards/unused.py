"""guards.unused_params: name trainable parameters that got no gradient in the first step."""

from __future__ import annotations

import logging

from torch import nn

from ..loop.steps import short

log = logging.getLogger("saferun")


def report_unused_parameters(model: nn.Module) -> bool:
    """After the first backward: warn naming trainable parameters that got no gradient.
    Returns False (nothing left to check), for the caller's pending flag."""
    unused = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    if unused:
        log.warning(
            "%d trainable parameter(s) received no gradient in the first step: %s. "
            "training_step's loss does not depend on them; if that is intended, freeze them "
            "(trainer.frozen_modules) so that weight decay does not move them, and note that "
            "DistributedDataParallel needs find_unused_parameters=True for them.",
            len(unused), short(unused))
    return False
