"""Anomaly replay: run one bad batch again under autograd's anomaly mode and say where it broke.

`torch.autograd.detect_anomaly` costs 2.4-4x per step on small models, so
saferun does not train under it. When the non-finite guard fires, the loop
can call `replay(run, model)` with a function that recomputes forward and
backward for the offending batch. Anomaly mode (check_nan=True) raises at
the first backward function that returns NaN and attaches, as a warning, the
forward traceback of the op that created that function; `replay` captures
both as data. Anomaly mode checks NaN only, never Inf, so the report also
names the first module whose forward output is non-finite and the first
parameter whose gradient is non-finite.

The replay repeats the batch's side effects (BatchNorm statistics,
gradients) and draws new random numbers unless the caller restores the RNG
state of the step: use it when the step is being discarded anyway.

`replay_bad_step` is the diagnosis guards.anomaly_replay adds to a non-finite step's error:
the loop hands it the checkpoints, the batch stream and its step functions, and it re-runs the
run from the newest checkpoint before the bad step up to that step, which it replays.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Protocol

import torch
from torch import nn

from ..errors import SaferunError

_NAN_ERROR = re.compile(r"Function '(\w+)' returned nan values in its (\d+)\w* output")
_TRACE_MARK = "Traceback of forward call that caused the error:"
_ANOMALY_WARNINGS = ("Anomaly Detection has been enabled", "Error detected in ")
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


@dataclass
class ReplayReport:
    """What the replay found; None where it found nothing."""

    backward_op: Optional[str] = None
    """Backward function that returned NaN, e.g. 'LogBackward0'."""
    forward_trace: Optional[str] = None
    """Traceback of the forward call that created `backward_op`."""
    loss: Optional[float] = None
    """What the replayed function returned, if it returned a scalar tensor."""
    first_bad_output: Optional[str] = None
    """First module, in execution order, whose forward output was not finite."""
    first_bad_grad: Optional[str] = None
    """First parameter, in model order, whose gradient is not finite."""

    def __str__(self) -> str:
        lines = ["Anomaly replay of the offending batch:"]
        if self.loss is not None:
            lines.append(f"  loss: {self.loss}")
        if self.first_bad_output is not None:
            lines.append(f"  first non-finite forward output: {self.first_bad_output}")
        if self.backward_op is not None:
            lines.append(f"  backward: {self.backward_op} returned NaN; the forward call that "
                         f"created it:")
            lines.extend(f"    {line}" for line in (self.forward_trace or "(none)").splitlines())
        else:
            lines.append("  backward: no backward function returned NaN. Anomaly mode checks NaN "
                         "only, not Inf, so it cannot localise an Inf gradient.")
        if self.first_bad_grad is not None:
            lines.append(f"  first non-finite gradient: {self.first_bad_grad}")
        return "\n".join(lines)


def replay(run: Callable[[], Any], model: Optional[nn.Module] = None) -> ReplayReport:
    """Call `run` (forward and backward of one batch) under anomaly mode and report what broke.

    With `model`, its gradients are cleared first, so the report sees only
    this batch's, and its modules' forward outputs are checked as they are
    produced. Exceptions other than anomaly mode's NaN error propagate.
    """
    report = ReplayReport()
    handles = []
    if model is not None:
        model.zero_grad(set_to_none=True)
        for name, module in model.named_modules():
            label = f"{name or '(model)'} ({type(module).__name__})"
            handles.append(module.register_forward_hook(_output_checker(label, report)))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.autograd.detect_anomaly(check_nan=True):
                try:
                    out = run()
                    if isinstance(out, torch.Tensor) and out.numel() == 1:
                        report.loss = float(out.detach())
                except RuntimeError as e:
                    match = _NAN_ERROR.search(str(e))
                    if match is None:
                        raise
                    report.backward_op = match.group(1)
    finally:
        for h in handles:
            h.remove()
    report.forward_trace = _forward_trace([str(w.message) for w in caught])
    for w in caught:  # pass on the warnings that are not anomaly mode's own
        if not str(w.message).startswith(_ANOMALY_WARNINGS):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if model is not None:
        report.first_bad_grad = first_nonfinite((n, p.grad) for n, p in model.named_parameters())
    return report


class Checkpoints(Protocol):
    """What the anomaly replay uses of the Checkpointer."""

    def latest(self) -> Optional[tuple[Path, dict[str, Any]]]: ...
    def restore(self, state: Mapping[str, Any]) -> None: ...


def replay_bad_step(bad_step: int, checkpoints: Checkpoints, running: Any, batches: Any,
                    state: Any, train_step: Callable[[Any], Any],
                    forward_backward: Callable[[Any], tuple[torch.Tensor, Any, int]],
                    model: nn.Module) -> str:
    """Re-run from the newest checkpoint to `bad_step` (restored, the log window `running`
    emptied; `train_step` over the `batches` stream's groups, `state` counting the steps), then
    that step's `forward_backward` under anomaly mode: the report, in words."""
    try:
        found = checkpoints.latest()
    except SaferunError as e:  # every checkpoint damaged
        return f"Anomaly replay: {e}"
    if found is None or found[1]["loop"]["step"] >= bad_step:
        return "Anomaly replay: no checkpoint before the bad step to replay from."
    checkpoints.restore(found[1])
    running.reset()
    for micro_batches, _, _ in batches.groups():
        if state.step + 1 == bad_step:
            # (B023 is a false alarm: replay() calls the lambda before the loop moves on)
            return str(replay(lambda: forward_backward(micro_batches)[0], model))  # noqa: B023
        train_step(micro_batches)
    return "Anomaly replay: the data ended before the bad step."


def first_nonfinite(named_tensors: Iterable[tuple[str, Optional[torch.Tensor]]]) -> Optional[str]:
    """Name the first tensor with a NaN or Inf, with the counts; None if all are finite.

    One host read for all tensors, one more for the counts of the bad one.
    None entries (parameters without a gradient) are skipped.
    """
    items = [(name, t.detach()) for name, t in named_tensors if t is not None]
    if not items:
        return None
    device = items[0][1].device
    finite = torch.stack([torch.isfinite(t).all().to(device) for _, t in items]).tolist()
    for (name, t), ok in zip(items, finite):
        if not ok:
            nan, inf = torch.stack([t.isnan().sum(), t.isinf().sum()]).tolist()
            return f"{name}: {nan} NaN and {inf} Inf of {t.numel()} values"
    return None


def _output_checker(label: str, report: ReplayReport) -> Callable[..., None]:
    def check(module: nn.Module, args: Any, output: Any) -> None:
        if report.first_bad_output is None:
            found = first_nonfinite((label, t) for t in _float_tensors(output))
            if found is not None:
                report.first_bad_output = found
    return check


def _float_tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() or obj.is_complex():
            yield obj
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _float_tensors(v)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _float_tensors(v)


def _forward_trace(messages: list[str]) -> Optional[str]:
    """The forward traceback from anomaly mode's warning, from `run` on, without torch's frames."""
    for message in messages:
        if _TRACE_MARK in message:
            trace = message.split(_TRACE_MARK, 1)[1].split("(Triggered internally at", 1)[0]
            frames = re.split(r"\n(?=  File \")", trace.strip("\n"))
            files = [_frame_file(f) for f in frames]
            start = max((i + 1 for i, f in enumerate(files) if f == __file__), default=0)
            kept = [fr.rstrip() for fr, f in zip(frames[start:], files[start:])
                    if not f.startswith(_TORCH_DIR)]
            return "\n".join(kept or [fr.rstrip() for fr in frames])
    return None


def _frame_file(frame: str) -> str:
    match = re.match(r'\s*File "([^"]+)"', frame)
    return match.group(1) if match else ""
