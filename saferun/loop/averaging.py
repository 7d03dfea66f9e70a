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

Under trainer.strategy=fsdp or mesh the parameters are DTensors, each rank holding its shards:
`ShardedWeightAverage` keeps the average as DTensors sharded like them, and each rank averages
its own shards (the same lerp, no communication per step). It is validated by putting the
averaged shards into the model for the pass (the model's own all-gathers then compute with
them), saved with the checkpoint's shards (DCP, resharded like the model on another number of
processes) and exported gathered, as model.pt is.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping, Optional, Union

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from ..errors import SaferunError
from ..distributed import is_dtensor


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
        _average(optimizer, self._avg, self._ema, self._raw, self._ema_copied, self._raw_copied,
                 self.averaged.n_averaged)

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

    def export(self) -> dict[str, torch.Tensor]:
        """The averaged weights for model_ema.pt: the model's state dict (every rank calls it)."""
        return self.module.state_dict()

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


def _average(optimizer: Any, avg: Callable[..., None], ema: list[torch.Tensor],
             raw: list[torch.Tensor], ema_copied: list[torch.Tensor],
             raw_copied: list[torch.Tensor], n_averaged: torch.Tensor) -> None:
    """One update of an average (both kinds): lerp the averaged tensors, copy the others."""
    found = getattr(optimizer, "found_inf", None)
    if found is not None and found.item():
        return
    with torch.no_grad():
        avg(ema, raw, None)
        if ema_copied:
            torch._foreach_copy_(ema_copied, raw_copied)
        n_averaged += 1


class ShardedWeightAverage:
    """The EMA of a model whose parameters are DTensors (trainer.strategy=fsdp or mesh), kept as
    DTensors sharded like them (plain tensors where the model's are: buffers, the parameters a
    tensor-parallel plan leaves whole); named as in the model's state dict (model.pt's names).
    Non-persistent buffers, which no state dict holds, are not averaged: validation uses the
    model's own."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, decay: float,
                 use_buffers: bool) -> None:
        self._model = model
        live = model.state_dict(keep_vars=True)  # the sharded parameters themselves
        params = {id(p) for p in model.parameters()}
        with torch.no_grad():  # W_0^ema = W_0, shard by shard
            self._copies = {name: t.detach().clone() for name, t in live.items()}
        self.n_averaged = torch.zeros((), dtype=torch.long, device=next(model.parameters()).device)
        averaged = [n for n, t in live.items()
                    if id(t) in params or (use_buffers and t.is_floating_point())]
        copied = [n for n in live if n not in set(averaged)]
        self._avg = get_ema_multi_avg_fn(decay)
        # each rank's own shards: the local tensors of the DTensors (the average's never change)
        self._ema = _local([self._copies[n] for n in averaged])
        self._ema_copied = _local([self._copies[n] for n in copied])
        self._raw, self._raw_copied = [live[n] for n in averaged], [live[n] for n in copied]
        self.hook = optimizer.register_step_post_hook(self._update)

    @property
    def module(self) -> nn.Module:
        """Refused: no module holds a sharded average whole (from_run evaluates model_ema.pt
        in one process, with a whole average)."""
        raise SaferunError("trainer.ema's average is sharded over the ranks (trainer.strategy="
                           "fsdp or mesh): no whole module holds it. Load model_ema.pt (whole) "
                           "into the model in one process, as Trainer.from_run does.")

    def _update(self, optimizer: Any, *_: Any) -> None:
        """After an optimizer step: each rank lerps its own shards, no collective, no host read.
        The model's local tensors are looked up each time: FSDP2 may re-point a parameter's
        local tensor (its lazy initialisation re-pads one that load_state_dict replaced)."""
        _average(optimizer, self._avg, self._ema, _local(self._raw), self._ema_copied,
                 _local(self._raw_copied), self.n_averaged)

    @contextlib.contextmanager
    def _in_model(self) -> Iterator[None]:
        """The averaged shards in the model's own tensors, the trained ones put back after
        (bit for bit, also when the pass raises). Between passes the model is resharded, so
        its next forward gathers these."""
        raw, ema = _local(self._raw + self._raw_copied), self._ema + self._ema_copied
        with torch.no_grad():
            kept = [t.clone() for t in raw]
            torch._foreach_copy_(raw, ema)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(raw, kept)

    def validate(self, owner: Any, validation_pass: Callable[[Any], dict[str, float]],
                 evaluator: Any) -> dict[str, float]:
        """`validation_pass` with the averaged weights in the model: the val_ema/... metrics."""
        with self._in_model():
            values = validation_pass(evaluator.for_model(self._model))
        return {f"val_ema/{k}": v for k, v in values.items()}

    def state_dict(self) -> dict[str, Any]:
        """The average itself (DTensors: a sharded checkpoint saves and loads them in place)."""
        return {**{f"module.{n}": t for n, t in self._copies.items()}, "n_averaged": self.n_averaged}

    def load_state_dict(self, state: Optional[Mapping[str, Any]]) -> None:
        """Restore (a no-op for what DCP loaded in place); None (a checkpoint from a run without
        trainer.ema): start from the weights."""
        with torch.no_grad():
            if state is None:
                torch._foreach_copy_(self._ema + self._ema_copied,
                                     _local(self._raw + self._raw_copied))
                self.n_averaged.zero_()
                return
            mine = self.state_dict()
            if state.keys() != mine.keys():
                missing, unknown = sorted(mine.keys() - state.keys()), sorted(state.keys() - mine.keys())
                raise SaferunError(f"the checkpoint's weight average (trainer.ema) does not fit "
                                   f"this model: missing {missing[:5]}, unexpected {unknown[:5]}. "
                                   f"Resume with the model that wrote it, or set "
                                   f"trainer.ema.decay=null.")
            for name, t in mine.items():
                if state[name] is not t:
                    t.copy_(state[name])

    def export(self) -> dict[str, torch.Tensor]:
        """Every rank: the whole average for model_ema.pt, gathered to rank 0's CPU ({} on the
        other ranks), as model.pt is."""
        import torch.distributed as dist

        main, whole = dist.get_rank() == 0, {}
        for name, t in self._copies.items():  # the same order on every rank: one gather each
            gathered = t.full_tensor() if is_dtensor(t) else t
            if main:
                whole[name] = gathered.detach().cpu()
        return whole


def _local(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each DTensor's local part on this rank (under no_grad: the tensor itself, no copy)."""
    with torch.no_grad():
        return [t.to_local() if is_dtensor(t) else t for t in tensors]  # type: ignore[attr-defined]


Average = Union[WeightAverage, ShardedWeightAverage]


def validate_both(owner: Any, ema: Optional[Average], evaluator: Any,
                  validation_pass: Callable[[Any], dict[str, float]]) -> dict[str, float]:
    """`validation_pass(evaluator)` over the raw weights (val/...) and, with trainer.ema, the same
    pass over the averaged weights (val_ema/...)."""
    metrics = {f"val/{k}": v for k, v in validation_pass(evaluator).items()}
    if ema is not None:
        metrics.update(ema.validate(owner, validation_pass, evaluator))
    return metrics


def weight_average(model: nn.Module, optimizer: torch.optim.Optimizer,
                   cfg: Any) -> Optional[Average]:
    """trainer.ema's average of `model`, or None when it is off (decay null); sharded like the
    parameters when they are DTensors (trainer.strategy=fsdp or mesh)."""
    if cfg.decay is None:
        return None
    if any(is_dtensor(p) for p in model.parameters()):
        return ShardedWeightAverage(model, optimizer, cfg.decay, cfg.use_buffers)
    return WeightAverage(model, optimizer, cfg.decay, cfg.use_buffers)
