"""Parameters made trainable after training started: refused at the next log point.

fit() fixes the trainable parameters when training starts. The optimizer is built from them, and
the gradient clipping, the gradient norm, the spike guard and guards.check_params cover exactly
them. A parameter that becomes trainable later (`requires_grad_(True)` on a module frozen at the
start, or a layer added to the model mid-run) gets gradients that no optimizer applies, or, when
the user's optimizer held it all along, an update the clip never bounded: the run looks as if it
trained it and did not (or not as configured). Freezing mid-run is fine: a parameter without a
gradient is left as it is by torch's optimizers and skipped by the clip.

A parameter switched on only inside training_step (trained on some steps, off again at the log
point) is seen by what it got: outside the optimizer, its gradient (nothing zeroes it); held by
the user's optimizer, the optimizer state its update left (AdamW's moments, SGD's momentum; a
stateless optimizer's update leaves no trace). State the optimizer held when fit() started (a
resumed checkpoint's, from before the part was frozen) is not an update.
"""

from __future__ import annotations

from typing import Any, Iterable

from torch import nn
from torch.optim import Optimizer

from ..errors import SaferunError
from ..text import short


class TrainableSet:
    """At each log point (a step guard, guards/step_guards.py), refuses a parameter of `model`
    that is not one of `params`, the parameters training started with, and requires grad, holds
    a gradient or got optimizer state since `begin()`. `state`: the run's state, for the step
    the message names; `optimizers`: the run's optimizers."""

    def __init__(self, model: nn.Module, params: Iterable[nn.Parameter], state: Any,
                 optimizers: Iterable[Optimizer]) -> None:
        self.model, self.state, self.optimizers = model, state, list(optimizers)
        self.known = {id(p) for p in params}
        self.held_before: set[int] = set()

    def begin(self) -> None:
        """As fit() starts (after a resume's restore): the optimizer state held then."""
        self.held_before = {id(p) for opt in self.optimizers for p in opt.state}

    def at_log_point(self, extra: dict[str, Any]) -> None:
        late = [n for n, p in self.model.named_parameters()
                if id(p) not in self.known and (p.requires_grad or p.grad is not None or (
                    id(p) not in self.held_before and any(p in o.state for o in self.optimizers)))]
        if late:
            raise SaferunError(
                f"step {self.state.step}: parameters became trainable after training started: "
                f"{short(late)}; they require grad now, or got a gradient or an optimizer "
                f"update since (requires_grad on for some steps, e.g. inside training_step). "
                f"The optimizer, the gradient clipping and the "
                f"gradient norm cover the parameters that were trainable when fit() started, so "
                f"these would get gradients that are never applied (or updates the clip never "
                f"bounded): the run would look as if it trained them. Unfreezing (requires_grad_"
                f"(True), or a module of trainer.frozen_modules) or adding layers in the middle "
                f"of fit() is not supported; to fine-tune in stages, make each stage its own run "
                f"whose build_model loads the previous stage's model.pt, with the modules to "
                f"train trainable from the start.")
