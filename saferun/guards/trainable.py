"""Parameters made trainable after training started: refused at the next log point.

fit() fixes the trainable parameters when training starts. The optimizer is built from them, and
the gradient clipping, the gradient norm, the spike guard and guards.check_params cover exactly
them. A parameter that becomes trainable later (`requires_grad_(True)` on a module frozen at the
start, or a layer added to the model mid-run) gets gradients that no optimizer applies, or, when
the user's optimizer held it all along, an update the clip never bounded: the run looks as if it
trained it and did not (or not as configured). Freezing mid-run is fine: a parameter without a
gradient is left as it is by torch's optimizers and skipped by the clip.

A parameter switched on only inside training_step (trained on some steps, off again at the log
point) is seen by the gradient it got: a parameter outside the optimizer keeps it in `.grad`,
as nothing zeroes it (and one held by the user's optimizer with a stale gradient would be
stepped by it: torch's optimizers step any parameter with a gradient).
"""

from __future__ import annotations

from typing import Any, Iterable

from torch import nn

from ..errors import SaferunError
from ..text import short


class TrainableSet:
    """At each log point (a step guard, guards/step_guards.py), refuses a parameter of `model`
    that is not one of `params`, the parameters training started with, and requires grad or
    holds a gradient. `state`: the run's state, for the step the message names."""

    def __init__(self, model: nn.Module, params: Iterable[nn.Parameter], state: Any) -> None:
        self.model, self.state = model, state
        self.known = {id(p) for p in params}

    def at_log_point(self, extra: dict[str, Any]) -> None:
        late = [n for n, p in self.model.named_parameters()
                if (p.requires_grad or p.grad is not None) and id(p) not in self.known]
        if late:
            raise SaferunError(
                f"step {self.state.step}: parameters became trainable after training started: "
                f"{short(late)} (they require grad now, or got a gradient since: requires_grad "
                f"turned on for some steps, e.g. inside training_step). The optimizer, the gradient clipping and the "
                f"gradient norm cover the parameters that were trainable when fit() started, so "
                f"these would get gradients that are never applied (or updates the clip never "
                f"bounded): the run would look as if it trained them. Unfreezing (requires_grad_"
                f"(True), or a module of trainer.frozen_modules) or adding layers in the middle "
                f"of fit() is not supported; to fine-tune in stages, make each stage its own run "
                f"whose build_model loads the previous stage's model.pt, with the modules to "
                f"train trainable from the start.")
