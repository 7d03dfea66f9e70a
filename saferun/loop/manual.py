"""The step with several named optimizers, driven by the user's training_step.

When `build_optimizer` returns `{name: optimizer}`, `training_step(batch)` calls
`self.optimize(name, loss)` once per optimizer, in the order the algorithm needs (a GAN:
the discriminator, then the generator on the same batch). Each call is the single-optimizer
step's discipline for that optimizer alone:

    backward(loss scaled by the GradScaler, into this optimizer's parameters only)
    -> average those gradients over ranks (torchrun) -> unscale_ -> clip or measure the norm
    -> (skip policy: drop this update if the loss or norm is not finite, agreed over ranks)
    -> optimizer.step via the scaler -> zero_grad(set_to_none=True) -> its scheduler

from unscale_ on, the loop's one update after backward (`loop/update.py`), which the
single-optimizer step runs too.

`backward(inputs=...)` keeps the gradients of one optimizer's loss out of the others'
parameters (the generator's loss goes through the discriminator). After training_step, every
optimizer must have been called once; the scaler updates once; the step records the sum of the
losses and the total of the gradient norms (for the guards at log points) plus each one's own
(`train/loss/<name>`, `train/grad_norm/<name>`), all on the device: no host read per step
unless a skip policy asks, once per optimize().
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Iterator, Optional, Protocol, Sequence

import torch
from torch.autograd.graph import increment_version

from ..callbacks import StepOutput
from ..errors import SaferunError
from ..guards.step_guards import StepGuards
from .failure_site import record
from .frame import StepFrame
from .manual_checks import checked_loss, graph_slip
from .metrics import scalar_dict
from .optimizers import build_named, check_held
from ..schedules import Schedule
from .steps import check_optimizer_params
from .update import Gradients, OptimizerUpdate
from ..guards.unused import UnusedParameters, window
from ..data.transfer import samples_in


class ManualOwner(Protocol):
    """The public part of the Trainer the manual step uses (a Protocol: no import of the
    trainer); the loop's parts it works with are handed to `ManualSteps` by name."""

    cfg: Any
    optimizer: Any  # NamedOptimizers
    state: Any  # LoopState
    device: torch.device

    def training_step(self, batch: Any) -> Any: ...
    def batch_size(self, batch: Any) -> int: ...


class ManualSteps:
    """Runs one step of training_step with several optimizers and checks how it used them."""

    def __init__(self, trainer: ManualOwner, model: torch.nn.Module, frame: StepFrame,
                 update: OptimizerUpdate, *, schedule: Any, guards: StepGuards) -> None:
        """`model`: unwrapped (its parameter names are the messages'); `frame`: the step frame
        training_step runs in (its strategy and habits); `update`: the loop's one update after
        backward, run per optimizer (its GradScaler and BadStepPolicy); `schedule`: the
        NamedSchedules; `guards`: the in-loop guards the config turns on."""
        self._tr, self._frame, self._update, self._guards = trainer, frame, update, guards
        self._habits, self._strategy = frame.habits, frame.strategy
        self._scaler, self._guard, self._schedule = update.scaler, update.guard, schedule
        names = {id(p): n for n, p in model.named_parameters()}
        self.names = list(trainer.optimizer)
        # per optimizer: its trainable parameters with their names (for the DDP average's
        # messages); a frozen one it holds gets no gradient, so it stays as it is
        self.params = {name: [(names[id(p)], p) for g in opt.param_groups for p in g["params"]
                              if p.requires_grad] for name, opt in trainer.optimizer.items()}
        self._done: Optional[dict[str, tuple[torch.Tensor, torch.Tensor]]] = None  # in a step
        self._skipped: list[str] = []
        left = window(trainer.cfg.trainer.max_steps, trainer.state.step)
        self._unused = {name: UnusedParameters(params, left, name) for name, params in
                        self.params.items()} if trainer.cfg.guards.unused_params else {}
        self._replay: Optional[bool] = None  # an explanation's replay: optimize() updates nothing
        # how each optimizer's gradients are measured and clipped (checked at each step)
        self._grads = {name: Gradients([p for _, p in params], frame.strategy.meshes)
                       for name, params in self.params.items()}

    def step(self, micro_batches: Sequence[Any]) -> StepOutput:
        """One step: training_step on the batch, which calls optimize() once per optimizer."""
        tr, guards = self._tr, self._guards
        assert len(micro_batches) == 1  # trainer.accumulate > 1 is refused at setup
        for before in guards.before_step:  # a skip policy: the buffers as before this step
            before()
        samples = samples_in(micro_batches[0], tr.batch_size, f"step {tr.state.step + 1}")
        self._done, self._skipped = {}, []
        try:  # (DDP: buffers broadcast after training_step)
            out = self._frame.run(micro_batches[0])
            done = self._done
        finally:
            self._done = None
        step = tr.state.step + 1
        missing = [n for n in self.names if n not in done]
        if missing:
            raise SaferunError(
                f"step {step}: training_step did not call self.optimize(name, loss) for "
                f"{', '.join(map(repr, missing))} (it called {', '.join(map(repr, done)) or 'none'}). "
                f"With several optimizers every step updates each one once, so that its "
                f"schedule, gradient norm and checkpoint state stay in step with the loop.")
        logs = _user_logs(out, step)
        for check in guards.after_backward:  # declared modes
            if check(step):
                guards.drop(check)
        self._scaler.update()  # once per step, after every optimizer's unscale_ and step
        if self._skipped:
            return self._skip_step(samples)
        losses = [loss for loss, _ in done.values()]
        norms = [norm for _, norm in done.values()]
        for name, (loss, norm) in done.items():
            logs[f"loss/{name}"], logs[f"grad_norm/{name}"] = loss, norm
        tr.state.advance(samples)
        return StepOutput(loss=torch.stack(losses).sum(),
                          grad_norm=torch.linalg.vector_norm(torch.stack(norms)),
                          logs=logs, num_samples=samples)

    def optimize(self, name: str, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """`Trainer.optimize`: the single-optimizer discipline for optimizer `name` alone."""
        if self._replay is not None:
            return self._replayed(name, loss)
        try:
            self._optimize(name, loss, retain_graph)
        except BaseException as exc:  # the explanation names this call
            record(exc, optimizer=name, optimize_part="")
            raise

    def _optimize(self, name: str, loss: torch.Tensor, retain_graph: bool) -> None:
        tr = self._tr
        step = tr.state.step + 1
        if self._done is None:
            raise SaferunError("self.optimize(name, loss) is called from training_step, while "
                               "the loop runs a step (not from validation or after fit).")
        if name not in tr.optimizer:
            raise SaferunError(f"step {step}: self.optimize({name!r}, ...): no such optimizer; "
                               f"build_optimizer named {', '.join(map(repr, self.names))}.")
        if name in self._done:
            raise SaferunError(
                f"step {step}: self.optimize({name!r}, ...) was called twice in one step. Each "
                f"optimizer steps once per step (its schedule, gradient-norm log and checkpoint "
                f"follow the loop's steps); to update it twice, combine the losses or take "
                f"another step.")
        loss = checked_loss(name, loss, step)
        opt, scaler, grads = tr.optimizer[name], self._scaler, self._grads[name]
        params = grads.params
        with torch.autocast(tr.device.type, enabled=False):  # backward and step in full precision
            # Only this optimizer's parameters get gradients: another optimizer's loss flowing
            # through them (the generator's loss through the discriminator) leaves them alone.
            try:
                scaler.scale(loss).backward(inputs=params, retain_graph=retain_graph)
            except RuntimeError as exc:  # the ordering slip or a shared graph, in the user's terms
                slip = graph_slip(exc, name, step, {n: self.params[n] for n in self._done})
                if slip is None:
                    record(exc, optimize_part="backward")
                    raise
                raise slip from exc
            except BaseException as exc:
                record(exc, optimize_part="backward")
                raise
            unused = self._unused.get(name)  # guards.unused_params, in the first steps
            if unused is not None and unused.after_backward(step):
                del self._unused[name]
            self._strategy.average(self.params[name], step)  # torchrun: the mean over ranks
            loss = loss.detach()
            self._habits.saferun_steps = True  # inside training_step: this update's step,
            try:  # zero_grad and scheduler step are saferun's own
                norm, skipped, _, _ = self._update(opt, grads, self._schedule.by_name[name], loss)
            finally:
                self._habits.saferun_steps = False
            if skipped:
                self._skipped.append(name)  # this update is dropped; the others stand
        # A fused optimizer (or an update through .data) changes the weights without telling
        # autograd: mark them changed, so that a graph saved before this update (the ordering
        # slip, a retained graph) is refused by autograd's version check, never used stale.
        increment_version(params)
        self._done[name] = (loss, norm)

    @contextlib.contextmanager
    def replaying(self, backward: bool) -> Iterator[None]:
        """diagnose/explain.py replays a failed step's training_step: optimize() then steps no
        optimizer, scheduler or scaler; with `backward` (the in-place trace) it only runs the
        backward, whose gradients the replay restores."""
        self._replay = backward
        try:
            yield
        finally:
            self._replay = None

    def _replayed(self, name: str, loss: Any) -> None:
        if self._replay and isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.backward(inputs=[p for _, p in self.params.get(name, ())])

    def _skip_step(self, samples: int) -> StepOutput:
        """guards.nonfinite=skip: one or more updates of this step were dropped. The buffers go
        back to before the step (the bad batch's statistics too); the updates that were finite
        stand, as they were applied before the bad loss existed."""
        self._guard.end_skipped_step(samples, f"non-finite loss or gradients for optimizer(s) "
                                              f"{', '.join(map(repr, self._skipped))}; their "
                                              f"update was skipped")
        zero = torch.zeros((), device=self._tr.device)
        return StepOutput(loss=zero, grad_norm=zero, num_samples=samples, skipped=True)


def setup_optimizers(trainer: Any, model: torch.nn.Module) -> tuple[Any, Any, Any]:
    """After `build_optimizer` (Trainer.setup): (optimizer, scheduler, schedule). One
    optimizer: itself, `build_scheduler`'s scheduler, and their Schedule. {name: optimizer}:
    checked, and the containers of loop/optimizers.py (the loop then steps them through
    `ManualSteps`)."""
    if isinstance(trainer.optimizer, Mapping):
        return build_named(trainer, trainer.optimizer, model)
    check_optimizer_params(trainer.optimizer, model)
    check_held({"": trainer.optimizer}, model)  # any optimizer class, as for several
    scheduler = trainer.build_scheduler(trainer.optimizer)
    return trainer.optimizer, scheduler, Schedule(trainer.optimizer, scheduler,
                                                  trainer.cfg.trainer.sched_metric,
                                                  validates=trainer.val_loader is not None)


def _user_logs(out: Any, step: int) -> dict[str, torch.Tensor]:
    """training_step's return value with several optimizers: None or a dict of scalars."""
    if out is None:
        return {}
    if isinstance(out, torch.Tensor):
        raise SaferunError(
            f"step {step}: with several optimizers training_step calls self.optimize(name, loss) "
            f"for each and returns None or a dict of scalars to log, not a loss tensor (which "
            f"optimizer would it train?).")
    logs = {k: v.detach() for k, v in scalar_dict(out, "training_step").items()}
    clash = [k for k in logs if k == "loss" or k.startswith(("loss/", "grad_norm/"))]
    if clash:
        raise SaferunError(f"step {step}: training_step returned {', '.join(clash)}: saferun "
                           f"logs each optimizer's loss and gradient norm itself "
                           f"(train/loss/<name>, train/grad_norm/<name>). Rename them.")
    return logs
