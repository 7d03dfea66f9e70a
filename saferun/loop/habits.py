"""Habits from other frameworks, refused with what saferun does instead: a step hook that
takes more than the batch (`training_step(self, batch, batch_idx)`), checked at setup; and the
loop's own jobs done again inside training_step (a backward, an optimizer step, zero_grad, a
scheduler step, gradient clipping), refused before they change anything."""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from ..errors import SaferunError

STEP_HOOKS = ("training_step", "validation_step", "predict_step")
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def check_step_signatures(trainer: Any) -> None:
    """Each step hook must take the batch alone: saferun calls `hook(batch)`."""
    for hook in STEP_HOOKS:
        try:
            params = list(inspect.signature(getattr(trainer, hook)).parameters.values())
        except (TypeError, ValueError):  # a builtin or C callable: nothing to read
            continue
        required = [p.name for p in params if p.default is p.empty
                    and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        takes_one = any(p.kind in _POSITIONAL or p.kind == p.VAR_POSITIONAL for p in params)
        if len(required) <= 1 and takes_one:
            continue
        extra = ", ".join(required[1:]) or "the batch"
        raise SaferunError(
            f"{type(trainer).__name__}.{hook}({', '.join(p.name for p in params)}): saferun "
            f"calls {hook}(batch) with the batch alone, so {extra} would get no value. Define "
            f"{hook}(self, batch). Where a batch index or step is needed: self.step is the step "
            f"being computed, as the logs count it (1 in the first training_step), self.epoch "
            f"the epoch (from 0).")


def fit_arguments(trainer: Any, given: Sequence[Any]) -> SaferunError:
    """Lightning's `trainer.fit(model, loader)`: say where a saferun Trainer takes them from."""
    kinds = ", ".join(type(g).__name__ for g in given)
    return SaferunError(
        f"{type(trainer).__name__}.fit() takes no arguments (given: {kinds}): the Trainer builds "
        f"its parts itself. The model comes from build_model() (or the config's model node), the "
        f"datasets from build_datasets() (or the data node) and the DataLoader from "
        f"build_dataloaders(): override those hooks in your Trainer subclass, then call fit(). "
        f"Evaluation data goes to test(data) and predict(data).")


_WATCHING: "weakref.WeakSet[StepHabits]" = weakref.WeakSet()  # (the clip functions ask them)
_CLIPS = ("clip_grad_norm_", "clip_grad_value_", "clip_grad_norm")


class StepHabits:
    """Refuses an optimizer step or a backward made inside training_step, where saferun makes
    them itself from the returned loss (or in `self.optimize(name, loss)`).

    The optimizer step: a pre-hook on each optimizer raises while training_step runs, before
    the update (no weight changes). The backward: at the first step the gradients, unset
    before training_step, must still be unset after it (a one-off check; a later one shows as
    autograd's 'backward through the graph a second time', which `steps.explained` rewrites).
    Costs per step: two attribute writes, no host read.
    """

    def __init__(self) -> None:
        self.step = 0  # while training_step runs: the step it computes; else 0
        self.saferun_steps = False  # self.optimize() steps an optimizer inside training_step

    def watch(self, optimizers: Iterable[torch.optim.Optimizer],
              schedulers: Iterable[Any] = ()) -> None:
        """Refuse, while training_step runs, each optimizer's step and zero_grad, each
        scheduler's step, and torch's gradient clipping (torch.nn.utils.clip_grad_norm_,
        clip_grad_value_), unless saferun makes them (self.optimize())."""
        for opt in optimizers:
            opt.register_step_pre_hook(self._before_step)
            opt.zero_grad = self._refused(  # type: ignore[method-assign]
                opt.zero_grad, f"{type(opt).__name__}.zero_grad()")
        for sched in schedulers:
            # a subclass, not an instance attribute: a scheduler's state_dict is its __dict__
            cls = type(sched)
            sched.__class__ = type(cls.__name__, (cls,), {
                "step": self._refused(cls.step, f"{cls.__name__}.step()"),
                "__module__": cls.__module__, "__qualname__": cls.__qualname__})
        _WATCHING.add(self)
        _refuse_clipping()

    def _refused(self, fn: Callable[..., Any], what: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def refused(*args: Any, **kwargs: Any) -> Any:
            if self.step and not self.saferun_steps:
                raise SaferunError(_loop_job(self.step, what))
            return fn(*args, **kwargs)
        return refused

    def _before_step(self, optimizer: Any, *_: Any) -> None:
        if self.step and not self.saferun_steps:
            raise SaferunError(_loop_job(self.step, f"{type(optimizer).__name__}.step()"))

    def grads_before(self, params: Sequence[torch.Tensor]) -> bool:
        """At the first step only: does any parameter hold a gradient already?"""
        return any(p.grad is not None for p in params)

    def check_first_backward(self, params: Sequence[torch.Tensor], had_grads: bool, step: int
                             ) -> None:
        """After the first training_step (loop/frame.py's FirstBackward): a gradient that
        appeared is the user's backward."""
        if had_grads or not any(p.grad is not None for p in params):
            return
        raise SaferunError(
            f"step {step}: training_step ran a backward itself (the parameters have gradients "
            f"before saferun's backward; no weight has changed). saferun runs backward on the "
            f"loss training_step returns, then clips, checks and steps the optimizer: remove "
            f"loss.backward() (and any optimizer.step() or zero_grad()) from training_step and "
            f"return the loss. With several optimizers, return {{name: optimizer}} from "
            f"build_optimizer and call self.optimize(name, loss) in training_step for each.")


_DOES_INSTEAD = {
    "zero_grad()": "saferun zeroes the gradients itself after each update (set_to_none=True)",
    "step()": "saferun steps the optimizer and the scheduler itself after the backward",
    "clip_grad": "saferun clips the gradients itself before the update: set "
                 "trainer.max_grad_norm (e.g. trainer.max_grad_norm=1.0)",
}


def _loop_job(step: int, what: str) -> str:
    instead = next(v for k, v in _DOES_INSTEAD.items() if k in what)
    return (f"step {step}: training_step called {what} itself (refused before it changed any "
            f"weight): {instead}. saferun makes the backward, the gradient clipping, the "
            f"non-finite check, the optimizer and scheduler steps and zero_grad itself, from the "
            f"loss training_step returns: remove loss.backward(), optimizer.step() and "
            f"zero_grad() from training_step and return the loss; step no scheduler and clip no "
            f"gradient there either. With several optimizers, return {{name: optimizer}} from "
            f"build_optimizer and call self.optimize(name, loss) in training_step for each.")


def _refuse_clipping() -> None:
    """Wrap torch's gradient clipping functions (once per process) to refuse a call made
    inside a running training_step that is not saferun's own."""
    import torch.nn.utils as utils
    import torch.nn.utils.clip_grad as clip_grad

    for module in (utils, clip_grad):
        for name in _CLIPS:
            fn: Optional[Callable[..., Any]] = getattr(module, name, None)
            if fn is None or getattr(fn, "_saferun_refuses", False):
                continue
            setattr(module, name, _clip_refused(fn, name))


def _clip_refused(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def refused(*args: Any, **kwargs: Any) -> Any:
        for habits in _WATCHING:  # (a call from saferun itself does not come here)
            if habits.step and not habits.saferun_steps:
                raise SaferunError(_loop_job(habits.step, f"torch.nn.utils.{name}()"))
        return fn(*args, **kwargs)
    refused._saferun_refuses = True  # type: ignore[attr-defined]
    return refused
