"""Optional torch.compile, checked against eager on the first batch."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .errors import SaferunError


class CompileMismatchError(SaferunError):
    """The compiled model's output differs from eager beyond the configured tolerance."""


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
    if eager.shape != compiled.shape or not torch.allclose(compiled, eager, rtol=rtol, atol=atol):
        diff = (compiled - eager).abs().max().item() if eager.shape == compiled.shape else float("nan")
        raise CompileMismatchError(
            f"torch.compile changed the model's result on the first training batch: eager loss "
            f"{_show(eager)}, compiled {_show(compiled)} (max |diff| {diff:.3g} > atol {atol} + "
            f"rtol {rtol} * |eager|). Data-dependent Python control flow or in-place state "
            f"changes in forward are the usual cause. Set trainer.compile=false to train eagerly, "
            f"or loosen trainer.compile_rtol/compile_atol if the difference is rounding."
        )


def _show(t: torch.Tensor) -> str:
    return f"{t.item():.6g}" if t.numel() == 1 else f"tensor of shape {tuple(t.shape)}"
