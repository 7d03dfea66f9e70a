"""Activation checkpointing (`trainer.activation_checkpointing`): the modules of the named classes
keep only their inputs in the forward and recompute the rest in the backward, trading compute
for activation memory.

It uses torch's composable `checkpoint` (non-reentrant `torch.utils.checkpoint` run from module
hooks): in place, so parameter names and checkpoint keys do not change, and it composes with
FSDP2 (applied before sharding), torch.compile and the guards' replays.

One thing torch leaves to the user is made right here: the recomputation runs the module's
forward a second time, so a module that updates a buffer in its forward (BatchNorm's running
statistics and `num_batches_tracked`, or a user's own running statistics) would update it twice
per step: a silent change of the model. During the recomputation each buffer of the module is
replaced by a copy that is thrown away afterwards, so buffers are updated once, as without
checkpointing (tests/loop/test_activation_checkpointing.py compares the whole state).
"""

from __future__ import annotations

import contextlib
import difflib
import logging
from collections.abc import Iterator, Sequence
from typing import Callable

from torch import nn

from ..errors import ConfigError

log = logging.getLogger("saferun")


def apply_activation_checkpointing(model: nn.Module, class_names: Sequence[str]) -> list[str]:
    """Checkpoint every module of `model` whose class is named in `class_names` (the outermost
    one where matches nest); return the checkpointed modules' names. A name that matches no
    module is refused, naming the classes the model has."""
    if not class_names:
        return []
    from torch.distributed._composable import checkpoint

    wanted = set(class_names)
    _refuse_unknown(model, wanted)
    chosen: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if type(module).__name__ in wanted and not any(name.startswith(f"{c}.") or c == "" for c, _ in chosen):
            chosen.append((name, module))
    for _, module in chosen:
        checkpoint(module, context_fn=_recompute_keeps_buffers(module))
    names = [n or "(the whole model)" for n, _ in chosen]
    log.info("activation checkpointing: %d module(s) of %s recompute their forward in the backward "
             "(%s)", len(names), ", ".join(sorted(wanted)), _shorten(names))
    return names


def _refuse_unknown(model: nn.Module, wanted: set[str]) -> None:
    present = sorted({type(m).__name__ for m in model.modules()})
    missing = sorted(wanted - set(present))
    if missing:
        close = difflib.get_close_matches(missing[0], present, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"trainer.activation_checkpointing names the module class {missing[0]!r}, but no module "
            f"of the model is of that class.{hint} Name the classes of the blocks to recompute, e.g. "
            f"the transformer block; the model's module classes are: {', '.join(present)}.")


def _recompute_keeps_buffers(module: nn.Module) -> Callable[[], tuple[contextlib.AbstractContextManager,
                                                                         contextlib.AbstractContextManager]]:
    """checkpoint's context_fn: nothing around the forward; buffers kept around the recompute."""
    return lambda: (contextlib.nullcontext(), _buffers_kept(module))


@contextlib.contextmanager
def _buffers_kept(module: nn.Module) -> Iterator[None]:
    """While the forward is recomputed, each buffer is a copy: what the second forward writes
    into it (running statistics) is dropped, and the first forward's update stands."""
    held = [(m, name, b) for m in module.modules() for name, b in m._buffers.items() if b is not None]
    for m, name, b in held:
        m._buffers[name] = b.clone()
    try:
        yield
    finally:
        for m, name, b in held:
            m._buffers[name] = b


def _shorten(names: list[str], keep: int = 4) -> str:
    return ", ".join(names[:keep]) + (f", ... ({len(names) - keep} more)" if len(names) > keep else "")
