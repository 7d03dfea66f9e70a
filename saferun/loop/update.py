"""The update after backward: one implementation for every optimizer step of the loop.

    unscale_ (GradScaler) -> clip or measure the gradient norm -> the bad-step verdict (a skip
    policy: drop a non-finite or spiking update) -> optimizer.step via the scaler ->
    zero_grad(set_to_none=True) -> its scheduler (only if the optimizer really stepped)

The single-optimizer step (`Trainer.train_step`) runs it once per step; with several named
optimizers, each `optimize(name, loss)` runs it for that optimizer (`loop/manual.py`). The
scaler's `update()` stays with the caller: once per step, after every optimizer's step.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import nn

from .failure_site import record
from .steptimer import StepTimer

# torch's function itself: saferun's own clipping never goes through the wrapper that refuses a
# clip inside training_step (loop/habits.py), so it costs no call per step
_clip_grad_norm = torch.nn.utils.clip_grad.clip_grad_norm_


class OptimizerUpdate:
    """Applies one optimizer's update from the gradients its backward left."""

    def __init__(self, scaler: Any, guard: Any, max_grad_norm: Optional[float],
                 meshes: bool = False, timer: Optional[StepTimer] = None) -> None:
        """`scaler`: the GradScaler (disabled outside fp16); `guard`: the BadStepPolicy (its
        spike detectors and skip verdict); `meshes`: the parameters may lie on several device
        meshes (the strategy's `meshes`); `timer`: the loop's StepTimer, told which part of
        the update is the guards'."""
        self.scaler, self.guard = scaler, guard
        # fp16: the scaler scales, unscales and steps; disabled it passes everything through,
        # so the steps do not call it (four Python calls per step)
        self.scaling: bool = scaler.is_enabled()
        self._max_grad_norm, self._meshes = max_grad_norm, meshes
        self._timer = timer or StepTimer(torch.device("cpu"), 1)  # (never started: never on)

    def __call__(self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter],
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
        norm = clip_or_measure(params, self._max_grad_norm, self._meshes)
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
        # the class's zero_grad, not the instance's wrapper that refuses one inside training_step
        type(optimizer).zero_grad(optimizer, set_to_none=True)
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
