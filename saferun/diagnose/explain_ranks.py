"""Explaining a failure under torchrun without a collective (see `explain.py`).

On one process, explain.py finds the failing module by replaying the batch's forward. Under
torchrun a forward may take part in collectives (FSDP's all-gathers, SyncBatchNorm, a user's
own all_reduce; DDP's backward hooks in the in-place replay): a replay on the failing rank
alone would wait for ranks that are not replaying, or pair with a collective they are in and
desynchronise them. So there the module is read from the traceback's frames instead.

A rank whose collective failed because another rank failed first (its peer's connection
closed, or the wait timed out) is not explained as a mistake in its own step: its error
says so, pointing at the other rank's (the original chained as its cause).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
from torch import nn

from ..distributed import PEER_FAILED, several_ranks
from ..guards.batchinfo import describe_batch

_MODULE_PY = os.path.join("torch", "nn", "modules", "module.py")
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def collective_failed(exc: BaseException) -> bool:
    """Under torchrun: a collective's error caused by another rank (gone or late). Raised by
    torch itself: a user's own RuntimeError whose message happens to match is the user's."""
    return (isinstance(exc, RuntimeError) and several_ranks() and bool(PEER_FAILED.search(str(exc)))
            and _raised_in_torch(exc))


def _raised_in_torch(exc: BaseException) -> bool:
    """Is the traceback's innermost frame torch's (a collective, DDP's backward)?"""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename.startswith(_TORCH_DIR)


def collective_failure(exc: BaseException, rank: int, step: int, timeout: float) -> Optional[str]:
    """What a rank that stops because a collective failed says: one message, raised as its
    error (so that it is printed with the rest of it, on stderr, not as a log line apart), once
    per error (the evaluation pass and then fit both see one raised in validation)."""
    if getattr(exc, "_saferun_reported", False):
        return None
    exc._saferun_reported = True  # type: ignore[attr-defined]
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (f"rank {rank} stopped after step {step}: a collective with the other ranks failed "
            f"({first[:300]}). Another rank most likely failed first: its own error, printed by "
            f"that rank (torchrun's 'Root Cause'), says what went wrong; or a rank took longer "
            f"than trainer.collective_timeout={timeout:g}s to reach the same point. Nothing is "
            f"known to be wrong on rank {rank}.")


def locate_in_traceback(exc: BaseException, model: nn.Module
                        ) -> tuple[Optional[str], Optional[str]]:
    """(module path and type, its inputs) of the deepest frame in the traceback that runs a
    method of one of `model`'s modules (its forward, usually): the module that raised."""
    names = {id(m): (n or "(model)", type(m).__name__) for n, m in model.named_modules()}
    found: tuple[Optional[str], Optional[str]] = (None, None)
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        me = frame.f_locals.get("self")
        if id(me) in names and not frame.f_code.co_filename.endswith(_MODULE_PY):
            name, kind = names[id(me)]
            found = (f"'{name}' ({kind})", "; ".join(describe_batch(_arguments(frame), "input"))
                     or None)
        tb = tb.tb_next
    return found


def _arguments(frame: Any) -> tuple[Any, ...]:
    """The frame's positional arguments after self, and its *args."""
    code, values = frame.f_code, frame.f_locals
    args = [values.get(n) for n in code.co_varnames[1:code.co_argcount]]
    if code.co_flags & 0x04:  # CO_VARARGS: the name after the positional ones (and kw-only)
        args += list(values.get(code.co_varnames[code.co_argcount + code.co_kwonlyargcount], ()))
    return tuple(args)
