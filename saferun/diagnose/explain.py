"""Errors raised in the user's code (training_step, validation_step, the model's forward),
explained in the user's terms: the step, the batch's fields, the module and the fix.

Nothing here runs until a step has already failed. The phase and the failing batch are what
the loop's call sites recorded on the exception as it passed them (loop/failure_site.py: a
`try` around each step, free until something raises), and the module is found by replaying
that batch's forward once with forward hooks installed only then. The replay runs in the
step's modes under `torch.no_grad()` (forward only: no gradient and no optimizer touched)
with every RNG and every buffer (BatchNorm statistics) restored after it, so the training
state is as the failure left it. An in-place autograd error is replayed with
backward under anomaly mode instead (gradients restored after it) to name the forward line.
With several optimizers, the replay's `self.optimize()` calls step nothing (explain_optimize.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import warnings
from typing import Any, Callable, ContextManager, Iterator, Optional, Protocol

import torch
from torch import nn

from ..errors import (ExplainedAssertionError, ExplainedAttributeError, ExplainedIndexError,
                      ExplainedKeyError, ExplainedRuntimeError, ExplainedTypeError,
                      ExplainedValueError, UserCodeError)
from ..data.seeding import preserved_rng
from ..distributed import several_ranks
from ..guards.batchinfo import describe_batch, nonfinite_fields, tensors as _tensors
from .explain_optimize import in_step as _in_step, replaying as _replaying
from ..loop.failure_site import site_of
from .explain_ranks import collective_failed, collective_failure, locate_in_traceback
from ..guards.model_audit import carried_graph_advice, graph_carriers
from ..guards.replay import _forward_trace

_SAFERUN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


_TYPED: dict[type, type[UserCodeError]] = {
    RuntimeError: ExplainedRuntimeError, ValueError: ExplainedValueError,
    TypeError: ExplainedTypeError, IndexError: ExplainedIndexError, KeyError: ExplainedKeyError,
    AttributeError: ExplainedAttributeError, AssertionError: ExplainedAssertionError}


class FailureOwner(Protocol):
    """The part of the Trainer an explanation reads (no import of the trainer: no cycle)."""

    model: nn.Module
    device: torch.device
    state: Any
    train_loader: Any
    cfg: Any

    def training_step(self, batch: Any) -> Any: ...
    def validation_step(self, batch: Any) -> Any: ...
    def predict_step(self, batch: Any) -> Any: ...


@dataclasses.dataclass(frozen=True)
class StepContexts:
    """How the loop runs a step, for a replay: the precision's autocast and the evaluation
    modes (eval mode, inference_mode) of validation and predict."""

    autocast: Callable[[], ContextManager[Any]]
    evaluating: Callable[[], ContextManager[Any]]
    manual: Any = None  # several optimizers: the ManualSteps (its replay steps nothing)


def explain_failure(exc: BaseException, owner: FailureOwner, contexts: StepContexts
                    ) -> Optional[UserCodeError]:
    """If `exc` was raised while a training, validation or predict step ran, the explained error
    (raise it `from exc`); else None. Never raises itself."""
    try:
        if collective_failed(exc):  # under torchrun, because another rank failed: not this step
            said = collective_failure(exc, owner.state.rank, owner.state.step,
                                      owner.cfg.trainer.collective_timeout)
            if said is None:
                return None
            error = ExplainedRuntimeError(said)
            error.original = exc
            return error
        if type(exc) not in _TYPED:  # e.g. a user's own exception class: left exactly as raised
            return None
        found = _failing_step(exc, owner)
        if found is None:
            return None
        return _explain(exc, owner, contexts, *found)
    except Exception:  # an explanation must never hide the user's error
        return None


_HOOKS = {"training": "training_step", "validation": "validation_step", "test": "test_step",
          "predict": "predict_step"}


def _failing_step(exc: BaseException, owner: FailureOwner) -> Optional[tuple[str, Any]]:
    """('training', 'validation' or 'predict', the batch on the device), as the loop's call
    site recorded them on `exc` (loop/failure_site.py); None if no step raised it."""
    from ..data.transfer import move_to_device

    site = site_of(exc)
    if site is None or site.phase is None:
        return None
    return site.phase, move_to_device(site.batch, owner.device, False)


def _explain(exc: BaseException, owner: FailureOwner, contexts: StepContexts, phase: str,
             batch: Any) -> UserCodeError:
    model = _plain(owner.model)
    step = owner.state.step + 1 if phase == "training" else owner.state.step
    hook = _HOOKS[phase]
    fields = describe_batch(batch)
    message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    carriers = graph_carriers(model) if _SECOND_BACKWARD in message else []  # before a replay
    module, inputs, replayed = ((*locate_in_traceback(exc, model), None) if several_ranks()
                                else _locate(owner, contexts, model, phase, batch))
    what, fix = (("backward reached into the graph of an earlier step, which that step's "
                  "backward had already freed.", carried_graph_advice(carriers)) if carriers else
                 _diagnose(message, exc, owner, contexts, model, phase, batch, fields, module, inputs))
    on_rank = f" on rank {owner.state.rank}" if several_ranks() else ""
    lines = [f"{hook} failed at step {step}{_in_step(exc)}{on_rank}: {what}"]
    if fix:
        lines.append(f"  what to do: {fix}")
    if module is not None:
        lines.append(f"  in module: {module} received {inputs or '(no tensor inputs)'}")
    line = user_line(exc)
    if line:
        lines.append(f"  raised from: {line}")
    lines.append(f"  batch: {'; '.join(fields) or type(batch).__name__}")
    bad = nonfinite_fields(batch)
    if bad:
        lines.append(f"  note: the batch already holds NaN/Inf: {'; '.join(bad)}")
    if replayed:
        lines.append(f"  (module found by {replayed}; the training state is as the failure "
                     f"left it)")
    lines.append(f"  original error: {type(exc).__name__}: {message}")
    error = _TYPED[type(exc)]("\n".join(lines))
    error.original = exc
    return error


# ------------------------------------------------------------------ what went wrong

_DEVICE = re.compile(r"same device|expected device|is on .* device|device type|"
                     r"Input type \(torch\.(cuda\.)?\w+\) and weight type \(torch\.cuda", re.I)
_DTYPE = re.compile(r"same dtype|expected scalar type|should be the same|dtype|"
                    r"type \(\w+\) and \w+ type", re.I)
_SHAPE = re.compile(r"shapes cannot be multiplied|size mismatch|must match the size|shape '|"
                    r"expected input|The size of tensor|Given groups|batch_size|to have \d+ "
                    r"channels|Expected \d+D|dimension|size of|shape", re.I)
_BN_ONE = "Expected more than 1 value per channel when training"
_INPLACE = "modified by an inplace operation"
_SECOND_BACKWARD = "Trying to backward through the graph a second time"


def _diagnose(message: str, exc: BaseException, owner: FailureOwner, contexts: StepContexts,
              model: nn.Module, phase: str, batch: Any, fields: list[str], module: Optional[str],
              inputs: Optional[str]) -> tuple[str, str]:
    """(what went wrong, what to do), in the user's terms."""
    params = [p for p in model.parameters()]
    where = f"module {module}" if module else "the code named below"
    if _INPLACE in message:
        trace = (_inplace_trace(owner, contexts, model, batch)
                 if phase == "training" and not several_ranks() else None)
        what = ("an in-place operation changed a tensor that autograd had saved for backward "
                f"({message.split(':', 1)[-1].split('; expected')[0].strip()}).")
        if trace:
            what += f" Anomaly-mode replay: that tensor was saved by this forward line:\n{trace}"
        return what, ("make the in-place operation that follows that line out of place "
                      "(x = x * 2 instead of x *= 2 or x.mul_(2); inplace=False in ReLU/Dropout), "
                      "or .clone() the tensor before changing it.")
    if _BN_ONE in message:
        return (f"a BatchNorm in training mode got a batch of one sample ({where}); it cannot "
                f"compute a variance from one value per channel."), _bn_one_fix(owner, phase)
    if _DEVICE.search(message):
        devices = sorted({str(p.device) for p in params})
        return (f"tensors on different devices met in {where}: the model's parameters are on "
                f"{', '.join(devices) or '?'}."), (
                "a tensor created inside forward without device= lands on the CPU (and one "
                "stored as a plain attribute is not moved by .to(device)): create it with "
                "device=x.device (torch.zeros(n, device=x.device)), or register it with "
                "self.register_buffer so that the Trainer moves it with the model.")
    if "expected target dtype" in message or "expected scalar type Long" in message:
        return ("the loss got targets of another dtype than it takes: cross_entropy and "
                "nll_loss take class indices as int64, shape (N,) (or class probabilities as "
                "floats of the logits' shape)."), (
                "make the labels int64: in the dataset (torch.tensor(label, dtype=torch.long)) "
                "or y.long() before the loss.")
    if _DTYPE.search(message) and "dimension" not in message:
        pdtype = _param_dtype(params)
        odd = [f for f, t in _tensors(batch) if t.is_floating_point() and t.dtype != pdtype]
        if odd:
            return (f"batch field {', '.join(odd)} is {_dtype_of(batch, odd[0])} but the model's "
                    f"parameters are {pdtype} (NumPy arrays are float64 by default)."), (
                    f"convert in the dataset (torch.as_tensor(a, dtype={pdtype}) or "
                    f"a.astype(numpy.float32) in __getitem__), so every batch arrives as {pdtype}.")
        return (f"a dtype mismatch in {where}: the model's parameters are {pdtype}."), (
                "cast the tensor created in your code to the parameters' dtype "
                "(x.to(self.weight.dtype)); targets of cross_entropy must be int64 (.long()).")
    if _SHAPE.search(message):
        got = f", which received {inputs}" if inputs else ""
        return (f"a shape mismatch in {where}{got}."), (
                "compare the shapes it received (above) with what its layer expects: a "
                "missing flatten, a wrong in_features/num_classes, or the batch's fields in "
                "another order than training_step unpacks them.")
    return f"{type(exc).__name__} raised in {where}.", ""


def _bn_one_fix(owner: FailureOwner, phase: str) -> str:
    loader = owner.train_loader
    sampler = getattr(getattr(loader, "batch_sampler", None), "batch_sampler", None)
    n = len(sampler.sampler) if sampler is not None and hasattr(sampler.sampler, "__len__") else None
    bs = owner.cfg.trainer.batch_size
    numbers = f" ({n} samples per epoch here, batch_size={bs}: {n} % {bs} == 1)" if n else ""
    return (f"the last batch of each epoch has one sample when the number of samples "
            f"% batch_size == 1{numbers}: set trainer.drop_last=true, or change "
            f"trainer.batch_size.")


# ------------------------------------------------------------------ where it went wrong

def _locate(owner: FailureOwner, contexts: StepContexts, model: nn.Module, phase: str, batch: Any
            ) -> tuple[Optional[str], Optional[str], Optional[str]]:
    """(module path and type, its inputs, how found) by replaying the batch's forward with
    pre- and post-forward hooks: a module entered and never left raised."""
    names = {id(m): (n or "(model)", type(m).__name__) for n, m in model.named_modules()}
    open_calls: list[tuple[str, str]] = []
    last_failed: list[tuple[str, str]] = []

    def enter(mod: nn.Module, args: Any) -> None:
        name, kind = names[id(mod)]
        open_calls.append((f"'{name}' ({kind})", "; ".join(describe_batch(args, "input"))))

    def leave(mod: nn.Module, args: Any, out: Any) -> None:
        open_calls.pop()

    handles = [m.register_forward_pre_hook(enter) for m in model.modules()]
    handles += [m.register_forward_hook(leave) for m in model.modules()]
    step_fn = getattr(owner, _HOOKS[phase])
    modes = contextlib.nullcontext() if phase == "training" else contexts.evaluating()
    try:
        with _state_kept(model), preserved_rng(), modes, torch.no_grad(), contexts.autocast(), \
                _replaying(contexts.manual, backward=False):
            try:
                step_fn(batch)
            except Exception:
                last_failed = list(open_calls)
    finally:
        for h in handles:
            h.remove()
    if last_failed:
        name, inputs = last_failed[-1]
        return name, inputs or None, ("one replay of the batch's forward under torch.no_grad() "
                                      "with RNG and buffers restored")
    return None, None, None


@contextlib.contextmanager
def _state_kept(model: nn.Module) -> Iterator[None]:
    """Restore every buffer (BatchNorm statistics) and gradient after the block."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    grads = [(p, None if p.grad is None else p.grad.detach().clone()) for p in model.parameters()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for p, g in grads:
            p.grad = g


def _inplace_trace(owner: FailureOwner, contexts: StepContexts, model: nn.Module, batch: Any
                   ) -> Optional[str]:
    """The forward line that saved the tensor an in-place operation later changed: one
    replay of forward and backward under anomaly mode (RNG, buffers, gradients restored)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with _state_kept(model), preserved_rng(), contexts.autocast(), \
                _replaying(contexts.manual, True):
            with torch.autograd.detect_anomaly(check_nan=False):
                try:
                    out = owner.training_step(batch)
                    if contexts.manual is None:  # several: optimize() did it
                        (out["loss"] if isinstance(out, dict) else out).backward()
                except RuntimeError:
                    pass
    trace = _forward_trace([str(w.message) for w in caught])
    if not trace:
        return None
    frames = re.split(r"\n(?=\s*File \")", trace)
    kept = [f for f in frames if not _in_saferun(f)]
    return "\n".join("    " + f.strip().replace("\n", "\n    ") for f in kept[-2:]) or None


def _in_saferun(frame: str) -> bool:
    m = re.match(r'\s*File "([^"]+)"', frame)
    return m is not None and os.path.abspath(m.group(1)).startswith(_SAFERUN_DIR)


def user_line(exc: BaseException) -> Optional[str]:
    """The deepest frame of the traceback in the user's code (not torch, not saferun)."""
    found = None
    tb = exc.__traceback__
    while tb is not None:
        path = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if not path.startswith((_TORCH_DIR, _SAFERUN_DIR)) and "<frozen" not in path:
            found = tb
        tb = tb.tb_next
    if found is None:
        return None
    import linecache

    code = found.tb_frame.f_code
    text = linecache.getline(code.co_filename, found.tb_lineno).strip()
    return f"{code.co_filename}:{found.tb_lineno} in {code.co_name}: {text}"


def _dtype_of(batch: Any, field: str) -> str:
    return next(str(t.dtype) for n, t in _tensors(batch) if n == field)


def _param_dtype(params: list[nn.Parameter]) -> torch.dtype:
    return params[0].dtype if params else torch.get_default_dtype()


def _plain(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model) if type(model).__name__ == "DistributedDataParallel" \
        else model
