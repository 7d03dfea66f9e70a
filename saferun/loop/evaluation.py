"""Evaluation passes (validation, test, predict): eval mode with every submodule's flag restored after,
no autograd, autocast, training's random streams untouched; with guards.eval_purity, the model
checked to be left as evaluation found it."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Mapping, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader

from .. import modes
from .failure_site import record
from ..guards.purity import changed as purity_changed
from ..guards.purity import check_purity, fingerprint
from ..preemption import StopRequested, shielded_iter
from .metrics import WeightedMeans, scalar_dict
from .stateful import compute_all, reset_all
from ..data.seeding import preserved_rng
from ..data.transfer import move_to_device, samples_in, to_host


class Evaluator:
    """Runs `validation_step` or `predict_step` over a loader (see `Trainer.validate`/`predict`)."""

    def __init__(self, model: nn.Module, device: torch.device, non_blocking: bool,
                 autocast: Callable[[], ContextManager[Any]], eval_grad_mode: str,
                 purity: bool, metrics: Mapping[str, Any] = {},
                 explain: Optional[Callable[[BaseException], Optional[BaseException]]] = None,
                 declared_modes: bool = True, after: Callable[[nn.Module], None] = lambda m: None,
                 group: Any = None) -> None:
        """`explain`: the Trainer's explanation of an error its step raised (diagnose/explain.py),
        or None. `after`: the strategy's step after each pass (FSDP: reshard the parameters);
        `group`: the data-parallel ranks, over which the means are reduced (None: every rank)."""
        self._model, self._device, self._non_blocking = model, device, non_blocking
        # guards.declared_modes: every module stays in eval mode through each evaluation step
        self._modes = modes.DeclaredModes(model, (), evaluation=True) if declared_modes else None
        self._autocast, self._grad_mode, self._purity = autocast, eval_grad_mode, purity
        self._metrics = metrics  # stateful (torchmetrics): reset before a pass, computed after
        self._explain = explain
        self._after, self._group = after, group

    def for_model(self, model: nn.Module) -> "Evaluator":
        """The same evaluation of another model (the averaged weights, trainer.ema)."""
        return Evaluator(model, self._device, self._non_blocking, self._autocast, self._grad_mode,
                         self._purity, self._metrics, self._explain, self._modes is not None,
                         self._after, self._group)

    def evaluating(self) -> contextlib.ExitStack:
        """Eval mode (every submodule's flag restored after), no autograd, autocast."""
        stack = contextlib.ExitStack()
        stack.callback(self._after, self._model)  # last: FSDP leaves the root gathered after eval
        stack.enter_context(modes.evaluating(self._model, self._grad_mode))
        stack.enter_context(self._autocast())
        return stack

    def validate(self, loader: DataLoader, step_fn: Callable[[Any], Any],
                 batch_size: Callable[[Any], int], limit: Optional[int],
                 stopped: Callable[[], bool], step: int,
                 finish: Optional[Callable[[], tuple[Mapping[str, torch.Tensor],
                                                     Mapping[str, torch.Tensor]]]] = None,
                 hook: str = "validation_step") -> dict[str, float]:
        """The batch-size-weighted means of `step_fn`'s values over `loader` and the stateful
        metrics' values (one host read). `finish()`, called after the batches still in eval mode
        and under the purity check, returns (values to average with weight 1, values already
        reduced over the ranks) to report with them. `hook`: the step's name, for messages
        (validation_step, or test_step for a test pass)."""
        means = WeightedMeans()
        reset_all(self._metrics)
        before = fingerprint(self._model) if self._purity else None
        # preserved_rng: randomness in validation must not shift training's random streams,
        # or the training results would depend on how often you validate.
        with self.evaluating(), preserved_rng():
            for i, batch in enumerate(shielded_iter(loader)):
                if limit is not None and i >= limit:
                    break
                if stopped():
                    raise StopRequested  # preemption must not wait for a long evaluation
                try:
                    out = step_fn(move_to_device(batch, self._device, self._non_blocking))
                except Exception as exc:  # here, not in fit: validate() is also called alone
                    self._raise_explained(exc, hook.split("_")[0], batch)
                    raise
                means.add(scalar_dict(out, hook),
                          samples_in(batch, batch_size, f"{hook.split('_')[0]} batch {i + 1}"))
            finished = finish() if finish is not None else ({}, {})
            means.add(finished[0], 1)
            modes_seen = self._modes.now() if self._modes is not None else None  # before restored
        probe = {"changed": purity_changed(before, fingerprint(self._model))} if before else {}
        computed = {**compute_all(self._metrics), **finished[1]}  # torchrun: every rank's state
        # one read: the means, the metrics and the purity flag
        values, flags = means.read(probe, self._device, computed, self._group)
        check_purity(before, self._model, flags.get("changed", 0.0), self._grad_mode, step)
        if modes_seen is not None:  # after purity, whose message names the changed buffers
            self._modes.check(step, hook, modes_seen)  # type: ignore[union-attr]  # seen: declared
        return values

    def predict(self, loader: DataLoader, step_fn: Callable[[Any], Any], step: int) -> Any:
        """`step_fn` over `loader`; tensors concatenated, other outputs a list, all on the CPU."""
        outputs = []
        before = fingerprint(self._model) if self._purity else None
        with self.evaluating():
            for batch in loader:
                try:
                    outputs.append(step_fn(move_to_device(batch, self._device, self._non_blocking)))
                except Exception as exc:
                    self._raise_explained(exc, "predict", batch)
                    raise
            modes_seen = self._modes.now() if self._modes is not None else None  # before restored
        if before is not None:
            check_purity(before, self._model, float(purity_changed(before, fingerprint(self._model))),
                         self._grad_mode, step)
        if modes_seen is not None:
            self._modes.check(step, "predict_step", modes_seen)  # type: ignore[union-attr]  # seen: declared
        # Outside inference mode, cat/clone turn inference tensors into normal ones,
        # which the caller may later use in autograd.
        if outputs and all(isinstance(o, torch.Tensor) for o in outputs):
            return torch.cat(outputs).cpu()
        return [to_host(o) for o in outputs]

    def _raise_explained(self, exc: BaseException, phase: str, batch: Any) -> None:
        """Raise `exc`, raised by the `phase` step on `batch` (as the loader gave it), explained
        in the user's terms (the step, the batch, the module), if it can be; else return (the
        caller re-raises it as it was)."""
        record(exc, phase=phase, batch=batch)
        error = self._explain(exc) if self._explain is not None else None
        if error is not None:
            raise error from exc
