"""Habits from other frameworks, refused with what saferun does instead: a step hook that
takes more than the batch (`training_step(self, batch, batch_idx)`), checked at setup; and a
backward or optimizer step made inside training_step, refused before it changes any weight."""

from __future__ import annotations

import inspect
from typing import Any, Iterable, Sequence

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
        self.first_pending = True

    def watch(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        for opt in optimizers:
            opt.register_step_pre_hook(self._before_step)

    def _before_step(self, optimizer: Any, *_: Any) -> None:
        if self.step and not self.saferun_steps:
            raise SaferunError(
                f"step {self.step}: training_step called {type(optimizer).__name__}.step() "
                f"itself (refused before it changed any weight). saferun makes the backward, the "
                f"gradient clipping, the non-finite check, the optimizer and scheduler steps and "
                f"zero_grad itself, from the loss training_step returns: remove loss.backward(), "
                f"optimizer.step() and zero_grad() from training_step and return the loss. With "
                f"several optimizers, return {{name: optimizer}} from build_optimizer and call "
                f"self.optimize(name, loss) in training_step for each.")

    def grads_before(self, params: Sequence[torch.Tensor]) -> bool:
        """At the first step only: does any parameter hold a gradient already?"""
        return any(p.grad is not None for p in params)

    def check_first_backward(self, params: Sequence[torch.Tensor], had_grads: bool, step: int
                             ) -> None:
        """After the first training_step: a gradient that appeared is the user's backward."""
        self.first_pending = False
        if had_grads or not any(p.grad is not None for p in params):
            return
        raise SaferunError(
            f"step {step}: training_step ran a backward itself (the parameters have gradients "
            f"before saferun's backward; no weight has changed). saferun runs backward on the "
            f"loss training_step returns, then clips, checks and steps the optimizer: remove "
            f"loss.backward() (and any optimizer.step() or zero_grad()) from training_step and "
            f"return the loss. With several optimizers, return {{name: optimizer}} from "
            f"build_optimizer and call self.optimize(name, loss) in training_step for each.")
