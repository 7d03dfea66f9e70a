"""The loss-call audit: torch's loss functions called with arguments that train silently wrong.

Active only while the first training step's `training_step` runs (a `TorchFunctionMode` sees
each call of `torch.nn.functional`'s losses, in functional and module form: `nn.MSELoss`
calls `F.mse_loss`). It reads the arguments once, then calls the loss as asked. Nothing runs
after the first step.

- Regression losses (mse, l1, smooth_l1, huber) broadcast an input and a target of different
  shapes: an (N, 1) prediction against an (N,) target gives an (N, N) loss of every prediction
  against every target. torch only warns, once. Refused when the input itself is broadcast.
- cross_entropy/nll_loss with class indices outside [0, C): refused with the samples and C
  (on a GPU torch stops with a device-side assert that names neither).
- Probabilities where scores are expected: cross_entropy applies log_softmax itself, so a
  softmax before it trains on a squashed signal; nll_loss and kl_div expect log-probabilities,
  so probabilities give -p instead of -log p. Refused. (log_softmax before cross_entropy is
  harmless, log_softmax being idempotent: not reported.) Unnormalised scores into nll_loss and
  a sigmoid's output into binary_cross_entropy_with_logits are warned about: rarely meant.
  Each warning is said once per loss line.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..errors import LossCallError
from .syncs import one_time_reads, pass_through

log = logging.getLogger("saferun")

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_SAFERUN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

pass_through(__file__)  # a host read in the step is the user's, not this mode's

_REGRESSION = {F.mse_loss: "mse_loss", F.l1_loss: "l1_loss", F.smooth_l1_loss: "smooth_l1_loss",
               F.huber_loss: "huber_loss"}
_CLASS_INDEX = {F.cross_entropy: "cross_entropy", F.nll_loss: "nll_loss"}


def user_line() -> str:
    """'file:line: code' of the innermost frame outside torch and saferun (the loss call)."""
    frame = sys._getframe(1)
    while frame is not None:
        file = os.path.abspath(frame.f_code.co_filename)
        if not file.startswith((_TORCH_DIR, _SAFERUN_DIR)):
            import linecache

            code = linecache.getline(file, frame.f_lineno).strip()
            return f"{file}:{frame.f_lineno}: {code}"
        frame = frame.f_back  # type: ignore[assignment]
    return "(line not found)"


class LossCallAudit(TorchFunctionMode):
    """Check the arguments of torch's loss functions while active (see the module docstring)."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step
        self.warnings: list[str] = []

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (),
                           kwargs: Optional[dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        if func in _REGRESSION or func in _CLASS_INDEX or func is F.kl_div \
                or func is F.binary_cross_entropy_with_logits:
            self._check(func, args, kwargs)
        return func(*args, **kwargs)

    def _check(self, func: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> None:
        names = ("input", "target")
        values = dict(zip(names, args))
        values.update({k: kwargs[k] for k in names if k in kwargs})
        x, y = values.get("input"), values.get("target")
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            return
        with torch.no_grad(), one_time_reads():  # counted apart: once per fit, never per step
            if func in _REGRESSION:
                found = _broadcast(_REGRESSION[func], x, y)
            elif func in _CLASS_INDEX:
                found = _class_index(_CLASS_INDEX[func], x, y, kwargs.get("ignore_index", -100))
            elif func is F.kl_div:
                found = _kl_input(x, kwargs.get("log_target", False))
            else:
                found = _logits_expected(x)
        if found is None:
            return
        severity, what = found
        verdict = "would train silently wrong" if severity == "error" else "looks wrong"
        message = f"the loss call at step {self.step} {verdict}: {what}\n  at: {user_line()}"
        if severity == "error":
            raise LossCallError(message)
        if message in self.warnings:  # the same line's loss, called again (a helper, a loop)
            return
        self.warnings.append(message)
        log.warning("%s", message)


def _broadcast(name: str, x: torch.Tensor, y: torch.Tensor) -> Optional[tuple[str, str]]:
    if x.shape == y.shape:
        return None
    try:
        shape = torch.broadcast_shapes(x.shape, y.shape)
    except RuntimeError:
        return None  # torch raises its own error for shapes that do not broadcast
    if shape == x.shape:
        return None  # the target is broadcast over the predictions (torch warns): meant, mostly
    return "error", (f"F.{name} got input of shape {tuple(x.shape)} and target of shape "
                     f"{tuple(y.shape)}, which broadcast to {tuple(shape)}: every prediction is "
                     f"compared with every target. Make the shapes equal (e.g. "
                     f"pred.squeeze(-1) for an (N, 1) prediction, or target.view_as(pred)).")


def _class_index(name: str, x: torch.Tensor, y: torch.Tensor, ignore: int
                 ) -> Optional[tuple[str, str]]:
    if y.is_floating_point() or x.dim() == 0:
        return _probabilities(name, x) if x.is_floating_point() else None
    classes = x.shape[1] if x.dim() >= 2 else x.shape[0]
    bad = ((y < 0) | (y >= classes)) & (y != ignore)
    if bool(bad.any()):
        where = bad.nonzero()
        samples = [tuple(i.tolist()) if len(i) > 1 else int(i) for i in where[:5]]
        values = sorted({int(v) for v in y[bad][:20].tolist()})
        return "error", (f"F.{name} got class indices {values} outside [0, {classes}) (C = "
                         f"{classes}, the size of the input's class dimension) at target "
                         f"positions {samples}{f' ({len(where)} in all)' if len(where) > 5 else ''}"
                         f". {_out_of_range_advice(y, bad, values, ignore)}")
    return _probabilities(name, x)


def _out_of_range_advice(y: torch.Tensor, bad: torch.Tensor, values: list[int], ignore: int) -> str:
    """What to do about targets outside [0, C): one value everywhere it is out of range marks
    positions to skip (padding, unlabelled), which is what ignore_index is for."""
    if len(values) == 1 and int(bad.sum()) > 1 and values[0] < 0 or \
            len(values) == 1 and _fills_row_ends(y, values[0]):
        v = values[0]
        return (f"Every out-of-range target is {v}, a marker of positions to skip (padding, "
                f"unlabelled), but the loss's ignore_index is {ignore}: pass ignore_index={v} to "
                f"the loss, or pad the targets with {ignore} (Hugging Face models ignore -100 "
                f"only).")
    return ("Labels must run from 0 to C-1: remap them (e.g. 1-based labels: y - 1), or give "
            "the model C outputs.")


def _fills_row_ends(y: torch.Tensor, v: int) -> bool:
    """`v` fills the end of some rows of a (N, T) target, as padding does."""
    return y.dim() >= 2 and bool((y[..., -1] == v).any()) and y.shape[-1] > 1


def _row_sums_one(x: torch.Tensor) -> bool:
    """Every value in [0, 1] and every row along dim 1 (dim 0 for a vector) sums to 1."""
    dim = 1 if x.dim() >= 2 else 0
    tolerance = _tolerance(x, dim)
    x = x.float()
    return bool(((x >= 0) & (x <= 1)).all()) and bool(
        ((x.sum(dim) - 1).abs() <= tolerance).all()) and x.shape[dim] > 1


def _log_normalised(x: torch.Tensor) -> bool:
    dim = 1 if x.dim() >= 2 else 0
    return bool((x.float().logsumexp(dim).abs() <= _tolerance(x, dim)).all())


def _tolerance(x: torch.Tensor, dim: int) -> float:
    """How far from exact a softmax or log_softmax made in x's dtype may sum: each of the
    row's values is rounded to the dtype (bf16 keeps 8 bits: 50 classes miss by 0.01 or more)."""
    eps = torch.finfo(x.dtype).eps if x.is_floating_point() else 0.0
    return max(1e-3, 4 * eps * x.shape[dim] ** 0.5) if x.dim() else 1e-3


def _probabilities(name: str, x: torch.Tensor) -> Optional[tuple[str, str]]:
    if not x.is_floating_point() or x.numel() == 0:
        return None
    if _row_sums_one(x):
        if name == "cross_entropy":
            return "error", ("F.cross_entropy got probabilities (every row is in [0, 1] and sums "
                             "to 1: a softmax before it?). cross_entropy applies log_softmax "
                             "itself: pass the raw scores (logits) and drop the softmax.")
        return "error", ("F.nll_loss got probabilities (every row is in [0, 1] and sums to 1): "
                         "it expects log-probabilities, so it would minimise -p instead of -log p."
                         " Use log_softmax instead of softmax, or cross_entropy on the logits.")
    if name == "nll_loss" and not _log_normalised(x):
        return "warn", ("F.nll_loss got scores that are not log-probabilities (their logsumexp "
                        "per row is not 0): nll_loss only picks -input[target], so unnormalised "
                        "scores are pushed without bound. Apply log_softmax first, or use "
                        "cross_entropy on the logits.")
    return None


def _kl_input(x: torch.Tensor, log_target: bool) -> Optional[tuple[str, str]]:
    if x.is_floating_point() and x.numel() and _row_sums_one(x):
        return "error", ("F.kl_div got probabilities as its input (every row is in [0, 1] and "
                         "sums to 1): its input must be log-probabilities (log_softmax), and its "
                         "target probabilities (or log-probabilities with log_target=True).")
    return None


_FIX = ("it applies the sigmoid itself. Pass the raw scores, or use binary_cross_entropy on "
        "probabilities.")
# autograd nodes that only reshape, select or cast: a sigmoid's output through them is still one
_SHAPE_ONLY = {"View", "UnsafeView", "Reshape", "ReshapeAlias", "Squeeze", "Unsqueeze", "Select",
               "Slice", "Expand", "T", "Transpose", "Permute", "Clone", "ToCopy", "Alias"}


def _logits_expected(x: torch.Tensor) -> Optional[tuple[str, str]]:
    """A sigmoid's outputs passed as logits. With autograd the graph says what made `x`
    (raw scores of an untrained model can all lie in (0, 1) by chance: a discriminator's, near
    its output bias). Without it, only values that look like a sigmoid's of such scores: at least
    8, all in (0, 1), their median between 0.2 and 0.8 (raw scores near 0 are not)."""
    if x.grad_fn is not None:
        return ("warn", f"F.binary_cross_entropy_with_logits got the output of a sigmoid: {_FIX}"
                ) if _made_by_sigmoid(x.grad_fn) else None
    if x.is_floating_point() and x.numel() >= 8 and bool(((x > 0) & (x < 1)).all()) \
            and 0.2 < float(x.float().median()) < 0.8:
        return "warn", ("F.binary_cross_entropy_with_logits got inputs all strictly between 0 "
                        f"and 1, around 0.5 (a sigmoid before it?): {_FIX}")
    return None


def _made_by_sigmoid(node: Any) -> bool:
    """The autograd node `node` is a sigmoid's, or a shape-only op's on one."""
    while node is not None:
        kind = type(node).__name__.rstrip("0123456789").removesuffix("Backward")
        if kind == "Sigmoid":
            return True
        if kind not in _SHAPE_ONLY:
            return False
        node = next((n for n, _ in node.next_functions if n is not None), None)
    return False
