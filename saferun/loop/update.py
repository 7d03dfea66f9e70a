"""The update after backward: one implementation for every optimizer step of the loop.

    unscale_ (GradScaler) -> clip or measure the gradient norm -> the bad-step verdict (a skip
    policy: drop a non-finite or spiking update) -> optimizer.step via the scaler ->
    zero_grad(set_to_none=True) -> its scheduler (only if the optimizer really stepped)

The norm and the zeroing are torch's (`clip_grad_norm_`, `get_total_norm`,
`Optimizer.zero_grad`) in result, bit for bit; where the parameters allow it (`Gradients`,
`release_grads`) they run without what those functions redo on every call for the general case.

The single-optimizer step (`Trainer.train_step`) runs it once per step; with several named
optimizers, each `optimize(name, loss)` runs it for that optimizer (`loop/manual.py`). The
scaler's `update()` stays with the caller: once per step, after every optimizer's step.
"""

from __future__ import annotations

import operator
from typing import Any, Optional, Sequence

import torch
from torch import nn

from .failure_site import record
from .steptimer import StepTimer

# torch's function itself: saferun's own clipping never goes through the wrapper that refuses a
# clip inside training_step (loop/habits.py), so it costs no call per step
_clip_grad_norm = torch.nn.utils.clip_grad.clip_grad_norm_
_foreach_norm, _foreach_mul_, _stack, _clamp = (torch._foreach_norm, torch._foreach_mul_,
                                                torch.stack, torch.clamp)
_vector_norm, _set_grad_enabled = torch.linalg.vector_norm, torch._C._set_grad_enabled
_profiling = torch._C._autograd._profiler_enabled
_ZERO_GRAD = torch.optim.Optimizer.zero_grad
_KIND = operator.attrgetter("__class__", "device", "dtype")  # (C calls only: ~0.2 us a tensor)


class Gradients:
    """The gradients of one optimizer's trainable parameters: their total 2-norm before
    clipping, and the clipping, as `clip_grad_norm_(params, max_norm)` computes them.

    Plain parameters on one CPU or CUDA device in one dtype (a single process, DDP) take a
    direct path: torch's own kernels in torch's own order (`_foreach_norm`, the norm of their
    stack, the coefficient max_norm / (norm + 1e-6) clamped at 1, `_foreach_mul_`), so the norm
    and the clipped gradients equal torch's bit for bit, without what its functions redo on
    every call for any set of tensors (grouping them by device and dtype, twice; three no_grad
    contexts; scripting and compile checks): about 25 us per step on a CPU, as much as the rest
    of the loop's own per-step cost on a small model. Any other set (several devices or dtypes,
    DTensors, FSDP shards, several meshes) goes through torch's functions. Decided from the
    parameters when built (at the Trainer's setup), and checked on the gradients at each step:
    a part of the model cast or moved during a fit(), or a gradient of another tensor type,
    goes through torch's functions from that step on (their norms are grouped by device and
    dtype, a different order of summation)."""

    def __init__(self, params: list[nn.Parameter], meshes: bool = False) -> None:
        self.params, self._meshes = params, meshes
        kinds = {(torch.Tensor, p.device, p.dtype) for p in params}  # (their gradients')
        self.direct = (not meshes and len(kinds) == 1 and next(iter(kinds))[1].type in ("cpu", "cuda")
                       and all(type(p) is nn.Parameter for p in params))
        self._kinds = kinds if self.direct else set()

    def norm(self, max_norm: Optional[float]) -> torch.Tensor:
        """The total 2-norm of the gradients before clipping; with `max_norm`, the gradients
        are clipped to it. Without, they are only measured (never clip_grad_norm_(inf): one
        inf gradient would turn every gradient into NaN)."""
        if not self.direct:
            return clip_or_measure(self.params, max_norm, self._meshes)
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads or set(map(_KIND, grads)) != self._kinds:  # none (torch's zero), or changed
            return clip_or_measure(self.params, max_norm)
        grad_mode = torch.is_grad_enabled()
        _set_grad_enabled(False)  # as torch's functions run (a C call: no context object)
        try:
            norm = _vector_norm(_stack(_foreach_norm(grads, 2.0)), 2.0)
            if max_norm is not None:  # (max_norm / t is torch's t.reciprocal() * max_norm)
                _foreach_mul_(grads, _clamp((norm + 1e-6).reciprocal() * max_norm, max=1.0))
        finally:
            _set_grad_enabled(grad_mode)
        return norm


def release_grads(optimizer: torch.optim.Optimizer) -> None:
    """`optimizer.zero_grad(set_to_none=True)`: every parameter's .grad set to None, as torch's
    does, without the profiler annotation it opens on each call (about 9 us per step on a CPU).
    Under the profiler, and for an optimizer class that defines its own zero_grad, that
    zero_grad runs: the class's, never the instance's wrapper that refuses a zero_grad inside
    training_step (loop/habits.py)."""
    zero_grad = type(optimizer).zero_grad
    if zero_grad is not _ZERO_GRAD or _profiling():
        zero_grad(optimizer, set_to_none=True)
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                p.grad = None


class OptimizerUpdate:
    """Applies one optimizer's update from the gradients its backward left."""

    def __init__(self, scaler: Any, guard: Any, max_grad_norm: Optional[float],
                 timer: Optional[StepTimer] = None) -> None:
        """`scaler`: the GradScaler (disabled outside fp16); `guard`: the BadStepPolicy (its
        spike detectors and skip verdict); `timer`: the loop's StepTimer, told which part of
        the update is the guards'."""
        self.scaler, self.guard = scaler, guard
        # fp16: the scaler scales, unscales and steps; disabled it passes everything through,
        # so the steps do not call it (four Python calls per step)
        self.scaling: bool = scaler.is_enabled()
        self._max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)  # (torch's)
        self._timer = timer or StepTimer(torch.device("cpu"), 1)  # (never started: never on)

    def __call__(self, optimizer: torch.optim.Optimizer, grads: Gradients,
                 schedule: Any, loss: torch.Tensor
                 ) -> tuple[torch.Tensor, bool, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(gradient norm before clipping, skipped, spiked, the loss spiked): the two spike
        flags on the device, None without a skip policy (guards.spikes=raise and rollback
        compare the steps at the log point). A skip policy reads one value per
        step from the device (agreed over ranks); otherwise nothing is read."""
        scaler, guard = self.scaler, self.guard
        if self.scaling:
            try:
                scaler.unscale_(optimizer)  # clip and measure the true gradients, not fp16-scaled ones
            except BaseException as exc:  # several optimizers: the explanation names this part
                record(exc, optimize_part="step")
                raise
        norm = grads.norm(self._max_grad_norm)
        timer = self._timer
        if timer.on:
            timer.lap("optimizer")
        # (device flags; without a skip policy the log point compares the steps, all at once)
        spike, loss_spike = guard.spike(loss, norm) if guard.spikes_each_step else (None, None)
        skipped = guard.skips and guard.bad_now(loss, norm, spike)
        if timer.on:
            timer.lap("guards")
        if not skipped:
            try:
                scaler.step(optimizer) if self.scaling else optimizer.step()
            except BaseException as exc:
                record(exc, optimize_part="step")
                raise
        release_grads(optimizer)  # zero_grad(set_to_none=True)
        if schedule.scheduler is not None:  # (none: no rate changes, nothing to step)
            schedule.after_step()  # steps the scheduler if the optimizer stepped (GradScaler)
        return norm, skipped, spike, loss_spike


def grad_accumulators(params: Sequence[nn.Parameter]) -> list[Any]:
    """Each plain trainable parameter's gradient accumulator (the autograd node that adds into
    `.grad`), for the Trainer to hold from the start of training until fit() returns.

    Autograd keeps an accumulator only while something refers to it: held by nobody, it dies
    with each step's graph after backward and the next forward builds it again. A hand-written
    loop keeps them by accident (its `loss` variable holds the last graph until the next step
    replaces it); saferun lets the step's graph go at once, so it holds them on purpose. Beyond
    the six rebuilt nodes per step of a small model, a parameter without that second owner
    pays a Python reference handoff in every optimizer op on it: together about 35,000
    instructions per step on the benchmark MLP (docs/benchmarks.md). Sharded and tensor-parallel parameters (tensor
    subclasses) are left alone."""
    held = []
    with torch.enable_grad():
        for p in params:
            if type(p) is nn.Parameter and p.requires_grad and p.grad_fn is None:
                node = p.view_as(p).grad_fn
                if node is not None and node.next_functions:
                    held.append(node.next_functions[0][0])
    return held


class ParamNorm:
    """guards.check_params at log points (a step guard, guards/step_guards.py): the total norm
    of the trainable parameters as train/param_norm, read with the window's metrics; a
    non-finite one makes the log point bad."""

    def __init__(self, params: list[nn.Parameter], meshes: bool = False) -> None:
        self._params, self._meshes = params, meshes

    def at_log_point(self, extra: dict[str, torch.Tensor]) -> None:
        extra["train/param_norm"] = total_norm(self._params, self._meshes)


def clip_or_measure(params: list[nn.Parameter], max_norm: Optional[float],
                    meshes: bool = False) -> torch.Tensor:
    """Clip to `max_norm` and return the pre-clip total norm; without clipping, only measure.
    `meshes`: the gradients may be DTensors on several device meshes (tensor parallel, 2-D),
    or DTensors and plain tensors (replicated); the norm is then the whole model's.

    Measuring never uses clip_grad_norm_(params, inf): with one inf gradient
    that turns every gradient into NaN.
    """
    if max_norm is None:
        return total_norm([p.grad for p in params if p.grad is not None], meshes)
    if meshes:
        groups = _by_mesh([p for p in params if p.grad is not None])
        norm = _combined([_global(torch.nn.utils.get_total_norm([p.grad for p in g]))
                          for g in groups])
        for g in groups:  # one foreach per mesh (torch's foreach does not mix them)
            torch.nn.utils.clip_grads_with_norm_(g, max_norm, norm)
        return norm
    norm = _clip_grad_norm(params, max_norm)
    return norm if type(norm) is torch.Tensor else _global(norm)  # (no failed getattr per step)


def total_norm(tensors: Sequence[torch.Tensor], meshes: bool = False) -> torch.Tensor:
    """The 2-norm of all `tensors` together; of the whole tensors when they are shards (FSDP)
    or, with `meshes`, DTensors on several meshes (each mesh's norm, then theirs)."""
    if meshes:
        return _combined([_global(torch.nn.utils.get_total_norm(g)) for g in _by_mesh(tensors)])
    return _global(torch.nn.utils.get_total_norm(tensors))


def _by_mesh(tensors: Sequence[Any]) -> list[list[Any]]:
    """`tensors` grouped by their device mesh (plain tensors: one group of their own)."""
    groups: dict[Any, list[Any]] = {}
    for t in tensors:
        groups.setdefault(getattr(t, "device_mesh", None), []).append(t)
    return list(groups.values())


def _combined(norms: list[torch.Tensor]) -> torch.Tensor:
    if not norms:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))


def _global(norm: torch.Tensor) -> torch.Tensor:
    # Over DTensor shards (FSDP) torch returns a DTensor: its full value is the norm of the
    # whole model, a plain tensor the metrics and guards can use. (No import of DTensor: it
    # costs every run a second of import time.)
    full = getattr(norm, "full_tensor", None)
    return full() if full is not None else norm
