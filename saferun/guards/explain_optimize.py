"""The several-optimizer step's part of an explanation (guards/explain.py): which
`self.optimize(name, loss)` call raised (or, with trainer.accumulate, which micro-batch), and a replay
of training_step in which optimize() updates nothing (loop/manual.py `ManualSteps.replaying`)."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from ..loop.steps import accumulate

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def manual(owner: Any) -> Any:
    """The step of several optimizers (ManualSteps), or a sentinel that is no frame's self."""
    return getattr(owner, "_manual", None) or _NONE


def replaying(owner: Any, backward: bool) -> Any:
    """Several optimizers: the replay's optimize() calls step no optimizer, scheduler or
    scaler (`backward`: they run the backward only, for the in-place trace)."""
    steps = getattr(owner, "_manual", None)
    return steps.replaying(backward) if steps is not None else contextlib.nullcontext()


def in_step(exc: BaseException, owner: Any) -> str:
    """Where in the step `exc` was raised: ", in self.optimize(...)" (see `in_optimize`), or
    " (micro-batch 3 of 3)" under trainer.accumulate (its frame's own locals), else ""."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is accumulate.__code__:
            values = tb.tb_frame.f_locals
            if "i" in values and "sizes" in values:
                return f" (micro-batch {values['i'] + 1} of {len(values['sizes'])})"
        tb = tb.tb_next
    return in_optimize(exc, owner)


def in_optimize(exc: BaseException, owner: Any) -> str:
    """", in self.optimize('gen', loss) (the backward of its loss)" when an optimize() call
    raised `exc`, else ""."""
    tb, name, part = exc.__traceback__, None, ""
    while tb is not None:
        code = tb.tb_frame.f_code
        if name is None and code.co_name == "optimize" and \
                tb.tb_frame.f_locals.get("self") is manual(owner):
            name = tb.tb_frame.f_locals.get("name")
        elif name is not None and not part and code.co_filename.startswith(_TORCH_DIR):
            where = code.co_filename[len(_TORCH_DIR):]
            part = (" (the backward of its loss)" if where.startswith("autograd")
                    or code.co_name == "backward" else " (its optimizer's step)"
                    if where.startswith(("optim", "amp")) else "")
        tb = tb.tb_next
    return f", in self.optimize({name!r}, loss){part}" if name is not None else ""


_NONE = object()
