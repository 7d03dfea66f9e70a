"""Module modes: frozen submodules, and evaluation that restores every flag it touched.

`Module.train()` recurses and has no memory of per-submodule modes, so calling
`model.train()` after validation would unfreeze a frozen BatchNorm (its running
statistics then drift even though its parameters have requires_grad=False).
saferun therefore never calls `model.train()` after evaluation: it saves each
submodule's flag and puts it back.
"""

from __future__ import annotations

import contextlib
import logging
import operator
from typing import Iterator, Optional, Sequence

import torch
from torch import nn

from .errors import ConfigError, SaferunError

log = logging.getLogger("saferun")
_TRAINING = operator.attrgetter("training")


def resolve_modules(model: nn.Module, names: Sequence[str]) -> list[nn.Module]:
    """Look up submodules by their `named_modules` path; a wrong name raises `ConfigError`."""
    known = dict(model.named_modules())
    missing = [n for n in names if n not in known]
    if missing:
        top = ", ".join(n for n in known if n and "." not in n) or "(none)"
        raise ConfigError(
            f"trainer.frozen_modules: no submodule named {', '.join(map(repr, missing))} in "
            f"{type(model).__name__}. Top-level submodules are: {top}. Use the dotted paths of "
            f"model.named_modules()."
        )
    return [known[n] for n in names]


def freeze(modules: Sequence[nn.Module]) -> None:
    """Put `modules` in eval mode and stop gradients to their parameters."""
    for m in modules:
        m.eval()
        m.requires_grad_(False)


def start_training(model: nn.Module, frozen: Sequence[nn.Module], frozen_names: Sequence[str]) -> None:
    """Train mode for everything except frozen modules; say so if the model was in eval."""
    if set_train_modes(model, frozen):
        log.info("The model was in eval mode (as pretrained loaders often return it); "
                 "saferun put it in train mode. Frozen modules kept in eval: %s.",
                 ", ".join(frozen_names) or "none declared")


def set_train_modes(model: nn.Module, frozen: Sequence[nn.Module]) -> bool:
    """Train mode for `model`, eval mode for the frozen submodules.

    Returns True if some module that is not frozen was in eval mode before (as
    a model from a pretrained loader often is), so the caller can say so.
    """
    frozen_ids = {id(m) for f in frozen for m in f.modules()}
    was_eval = any(not m.training for m in model.modules() if id(m) not in frozen_ids)
    model.train()
    for m in frozen:
        m.eval()
    return was_eval


@contextlib.contextmanager
def training(model: nn.Module, frozen: Sequence[nn.Module]) -> Iterator[None]:
    """The declared training modes (`set_train_modes`); restores every submodule's flag."""
    flags = [(m, m.training) for m in model.modules()]
    set_train_modes(model, frozen)
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


@contextlib.contextmanager
def evaluating(model: nn.Module, grad_mode: str = "inference_mode") -> Iterator[None]:
    """Eval mode plus `torch.inference_mode()` (or `no_grad`); restores every submodule's flag."""
    flags = [(m, m.training) for m in model.modules()]
    grad_ctx = torch.inference_mode() if grad_mode == "inference_mode" else torch.no_grad()
    model.eval()
    try:
        with grad_ctx:
            yield
    finally:
        for m, training in flags:
            m.training = training


class DeclaredModes:
    """What `train()`/`eval()` state every submodule must be in during training steps:
    frozen modules (and their children) in eval mode, all others in train mode; during
    evaluation (`evaluation=True`), every module in eval mode."""

    def __init__(self, model: nn.Module, frozen: Sequence[nn.Module], evaluation: bool = False
                 ) -> None:
        frozen_ids = {id(m) for f in frozen for m in f.modules()}
        named = [(name or type(model).__name__, m) for name, m in model.named_modules()]
        self.names = [name for name, _ in named]
        self.modules = [m for _, m in named]
        self.expected = [not evaluation and id(m) not in frozen_ids for m in self.modules]

    def now(self) -> list[bool]:
        """Every module's `training` flag, in order."""
        return list(map(_TRAINING, self.modules))  # C calls only: ~30 ns per module

    def after_backward(self, step: int) -> None:
        """The step guard (guards/step_guards.py), every step: the modes after training_step
        and its backward. One Python call when they hold."""
        if list(map(_TRAINING, self.modules)) != self.expected:
            self.check(step)

    def check(self, step: int, hook: str = "training_step", actual: Optional[list[bool]] = None
              ) -> None:
        """Raise `SaferunError` naming the first module whose mode differs from its declaration
        after `hook` ran (training_step; in evaluation, validation_step or predict_step, with
        the flags `now()` read at the end of the pass, before they were restored)."""
        actual = self.now() if actual is None else actual
        if actual == self.expected:
            return
        i = next(i for i, (a, e) in enumerate(zip(actual, self.expected)) if a != e)
        module = self.modules[i]
        where = f"step {step}: module '{self.names[i]}' ({type(module).__name__})"
        if hook != "training_step":
            raise SaferunError(
                f"{where} is in train mode during {hook}, which saferun runs in eval mode: "
                f"something in {hook} or forward called .train(), so this evaluation ran with "
                f"dropout on and BatchNorm using (and updating) batch statistics. saferun sets "
                f"eval mode for evaluation and restores every module's flag afterwards: remove "
                f"that call. (For dropout at evaluation on purpose, e.g. Monte-Carlo dropout, "
                f"call it functionally: F.dropout(x, p, training=True).)")
        now, declared = (("train", "eval (declared frozen in trainer.frozen_modules)")
                         if module.training else ("eval", "train"))
        raise SaferunError(
            f"{where} is in {now} mode but should be in {declared} mode. Something in "
            f"training_step or forward called .train() or .eval(); saferun sets the modes "
            f"itself, so remove that call, or declare the module in trainer.frozen_modules to "
            f"keep it in eval mode.")
