"""Weight averaging (trainer.ema): an exponential moving average of the weights, kept on the
device, updated after every optimizer step that ran, evaluated beside the raw weights (val_ema/...),
checkpointed with them and exported as model_ema.pt.

The average lives in a `torch.optim.swa_utils.AveragedModel` (its `.module` has the user's model
class, so model_ema.pt loads into it, and `swa_utils.update_bn` works on it), and is updated with
`swa_utils.get_ema_multi_avg_fn`. Not with `AveragedModel.update_parameters`: that reads
`n_averaged` on the host twice per call (a device sync per step on CUDA) and averages integer
buffers (BatchNorm's num_batches_tracked) through a float product truncated back to an integer,
which freezes them. Here floating parameters and buffers are averaged with one foreach lerp and
integer buffers are copied.

The update is the optimizer's step post-hook: it runs exactly when the optimizer stepped. A step
the skip policy dropped (guards.nonfinite=skip) or the GradScaler skipped (fp16, inf gradients)
leaves the average as it was. Under DDP every rank holds the same weights after a step, so every
rank's average is the same (rank 0's is saved).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


class WeightAverage:
    """The EMA of `model`'s weights (and, with `use_buffers`, of its floating buffers)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, decay: float,
                 use_buffers: bool) -> None:
        # the copy starts equal to the model: W_0^ema = W_0 (swa_utils' definition)
        self.averaged = AveragedModel(model, device=next(model.parameters()).device,
                                      use_buffers=use_buffers)
        self.module: nn.Module = self.averaged.module
        self.module.requires_grad_(False)  # only ever evaluated
        self._model = model
        self._avg = get_ema_multi_avg_fn(decay)
        averaged: list[tuple[torch.Tensor, torch.Tensor]] = list(zip(self.module.parameters(),
                                                                     model.parameters()))
        copied: list[tuple[torch.Tensor, torch.Tensor]] = []
        for e, r in zip(self.module.buffers(), model.buffers()):
            (averaged if use_buffers and e.is_floating_point() else copied).append((e, r))
        # bound once: the per-step update builds no lists
        self._ema, self._raw = [e for e, _ in averaged], [r for _, r in averaged]
        self._ema_copied, self._raw_copied = [e for e, _ in copied], [r for _, r in copied]
        self.hook = optimizer.register_step_post_hook(self._update)

    def _update(self, optimizer: Any, *_: Any) -> None:
        """After an optimizer step: a few device ops, no host read (but one for a fused
        optimizer under an enabled GradScaler, stepped with found_inf: it may have dropped
        the update inside its kernel)."""
        found = getattr(optimizer, "found_inf", None)
        if found is not None and found.item():
            return
        with torch.no_grad():
            self._avg(self._ema, self._raw, None)
            if self._ema_copied:
                torch._foreach_copy_(self._ema_copied, self._raw_copied)
            self.averaged.n_averaged += 1

    def validate(self, owner: Any, validation_pass: Callable[[Any], dict[str, float]],
                 evaluator: Any) -> dict[str, float]:
        """`validation_pass` with the averaged weights in `owner.model` (validation_step uses
        them) and in `evaluator`: the val_ema/... metrics."""
        owner.model = self.module
        try:
            values = validation_pass(evaluator.for_model(self.module))
        finally:
            owner.model = self._model
        return {f"val_ema/{k}": v for k, v in values.items()}

    def state_dict(self) -> dict[str, Any]:
        return self.averaged.state_dict()

    def load_state_dict(self, state: Optional[Mapping[str, Any]]) -> None:
        """Restore; None (a checkpoint from a run without trainer.ema): start from the weights."""
        if state is None:
            with torch.no_grad():
                for e, r in zip([*self.module.parameters(), *self.module.buffers()],
                                [*self._model.parameters(), *self._model.buffers()]):
                    e.copy_(r)
                self.averaged.n_averaged.zero_()
            return
        self.averaged.load_state_dict(state)


def validate_both(owner: Any, ema: Optional[WeightAverage], evaluator: Any,
                  validation_pass: Callable[[Any], dict[str, float]]) -> dict[str, float]:
    """`validation_pass(evaluator)` over the raw weights (val/...) and, with trainer.ema, the same
    pass over the averaged weights (val_ema/...)."""
    metrics = {f"val/{k}": v for k, v in validation_pass(evaluator).items()}
    if ema is not None:
        metrics.update(ema.validate(owner, validation_pass, evaluator))
    return metrics


def weight_average(model: nn.Module, optimizer: torch.optim.Optimizer,
                   cfg: Any) -> Optional[WeightAverage]:
    """trainer.ema's average of `model`, or None when it is off (decay null)."""
    if cfg.decay is None:
        return None
    return WeightAverage(model, optimizer, cfg.decay, cfg.use_buffers)
