"""Optional torch.compile, checked against eager on the first batch."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from .. import modes
from ..errors import CompileMismatchError
from ..data.seeding import get_rng_state, preserved_rng, set_rng_state
from .steps import loss_and_logs


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The original module of a `torch.compile(model)` wrapper (or `model` itself).

    saferun compiles in place with `Module.compile()`, so state_dict keys never
    gain the `_orig_mod.` prefix that the wrapper adds.
    """
    return getattr(model, "_orig_mod", model)


def check_compiled(compute: Callable[[], torch.Tensor], rtol: float, atol: float) -> None:
    """Run `compute` eagerly and compiled; raise `CompileMismatchError` if they disagree."""
    with torch.compiler.set_stance("force_eager"):
        eager = compute().detach().float()
    compiled = compute().detach().float()
    _compare("eval", "loss", eager, compiled, rtol, atol)


def check_compiled_training(step: Callable[[], torch.Tensor], model: nn.Module, rtol: float,
                            atol: float) -> None:
    """Run `step` (a training-mode forward and backward returning the loss) eagerly and
    compiled from the same buffers and RNG state; compare the loss, every gradient and every
    buffer after it (BatchNorm running statistics), raising `CompileMismatchError` on the first
    that differs. The buffers, the gradients and every RNG are left as they were.

    Dropout: with inductor, random ops are compiled to call torch's generator as eager does
    (`fallback_random`), so both runs draw the same numbers. That graph is the one training
    then reuses (the same module, modes and input shapes).
    """
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    buffers = list(model.named_buffers())
    saved_buffers = [b.detach().clone() for _, b in buffers]
    saved_grads = [p.grad for _, p in params]
    runs = []
    try:
        with preserved_rng():
            start = get_rng_state()
            for stance in ("force_eager", "default"):
                set_rng_state(start)
                for _, p in params:
                    p.grad = None
                with torch.compiler.set_stance(stance), _eager_random_numbers():
                    loss = step().detach().float()
                runs.append((loss, [p.grad for _, p in params],
                             [b.detach().clone() for _, b in buffers]))
                with torch.no_grad():
                    for (_, b), saved in zip(buffers, saved_buffers):
                        b.copy_(saved)
    finally:
        for (_, p), grad in zip(params, saved_grads):
            p.grad = grad
    (eager_loss, eager_grads, eager_buffers), (loss, grads, bufs) = runs
    _compare("training", "loss", eager_loss, loss, rtol, atol)
    for (name, _), e, c in zip(params, eager_grads, grads):
        if (e is None) != (c is None):
            raise _mismatch("training", f"the gradient of '{name}' is None in "
                            f"{'eager' if e is None else 'compiled'} mode only")
        if e is not None:
            _compare("training", f"the gradient of '{name}'", e.float(), c.float(), rtol, atol)  # type: ignore[union-attr]  # None with e only
    for (name, _), e, c in zip(buffers, eager_buffers, bufs):
        _compare("training", f"buffer '{name}' after the forward", e.float(), c.float(), rtol, atol)


def check_compiled_step(training_step: Callable[[Any], Any], batch: Any, model: nn.Module,
                        frozen: Any, evaluating: Callable[[], ContextManager[Any]],
                        autocast: Callable[[], ContextManager[Any]], rtol: float, atol: float) -> None:
    """Compiled against eager on `batch`: the loss in eval mode; the loss, gradients and buffers
    in training mode. Leaves the model, its gradients, its modes and every RNG as it found them."""

    def eval_loss() -> torch.Tensor:
        with evaluating():
            return loss_and_logs(training_step(batch), 1, need_grad=False)[0]

    def train_loss() -> torch.Tensor:
        with autocast():
            loss = loss_and_logs(training_step(batch), 1)[0]
        loss.backward()
        return loss

    with preserved_rng():
        check_compiled(eval_loss, rtol, atol)
    with modes.training(model, frozen):
        check_compiled_training(train_loss, model, rtol, atol)


def _eager_random_numbers() -> ContextManager[Any]:
    try:
        import torch._inductor.config as inductor_config
    except ImportError:  # a torch build without inductor
        return contextlib.nullcontext()
    return inductor_config.patch(fallback_random=True)


def _compare(mode: str, name: str, eager: torch.Tensor, compiled: torch.Tensor, rtol: float,
             atol: float) -> None:
    if eager.shape == compiled.shape and torch.allclose(compiled, eager, rtol=rtol, atol=atol):
        return
    if eager.shape != compiled.shape:
        raise _mismatch(mode, f"{name} has shape {tuple(compiled.shape)} compiled and "
                              f"{tuple(eager.shape)} eager")
    diff = (compiled - eager).abs().max().item()
    if eager.numel() == 1:
        what = f"eager {name} {eager.item():.6g}, compiled {compiled.item():.6g}"
    else:
        what = f"{name} differs, largest |eager| value {eager.abs().max().item():.3g}"
    raise _mismatch(mode, f"{what} (max |diff| {diff:.3g} > atol {atol} + rtol {rtol} * |eager|)")


def _mismatch(mode: str, what: str) -> CompileMismatchError:
    return CompileMismatchError(
        f"torch.compile changed the model's result on the first training batch in {mode} mode: "
        f"{what}. Data-dependent Python control flow, branches on torch.compiler.is_compiling(), "
        f"or in-place state changes in forward are the usual cause. Set trainer.compile=false "
        f"to train eagerly, or loosen trainer.compile_rtol/compile_atol if the difference is "
        f"rounding."
    )
