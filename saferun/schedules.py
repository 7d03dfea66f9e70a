"""Learning-rate schedules: when the loop steps them, and which rates each step used (`Schedule`
for one optimizer, `NamedSchedules` for several by name), and a forced resume's new values."""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any, Mapping, Optional

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, ReduceLROnPlateau

from .errors import ConfigError


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: Optional[int],
                  min_lr_ratio: float = 0.0) -> LambdaLR:
    """Linear warm-up from 0 over `warmup_steps`, then cosine decay to `min_lr_ratio` * lr."""
    if total_steps is None:  # (conf/sched/cosine.yaml: ${trainer.max_steps}, null with max_epochs alone)
        raise ValueError("warmup_cosine needs total_steps, the run's length in steps; it is null "
                         "(trainer.max_steps is null when only trainer.max_epochs is set). Set "
                         "trainer.max_steps, or sched.total_steps.")
    if warmup_steps < 0 or total_steps <= 0 or not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(
            f"warmup_cosine needs warmup_steps >= 0, total_steps > 0 and 0 <= min_lr_ratio <= 1; "
            f"got {warmup_steps}, {total_steps}, {min_lr_ratio}.")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)


class Schedule:
    """Steps the LR scheduler for the loop and remembers the rates the latest step used.

    A scheduler is stepped once per optimizer step that really ran: steps a skip
    policy drops, and steps whose `optimizer.step()` a GradScaler skipped on
    inf/NaN gradients, leave it where it was. A post-step hook on the optimizer
    tells which steps ran, so knowing costs no host sync. A scheduler stepped
    with a metric (`ReduceLROnPlateau`) is stepped after each validation with
    the metric `metric` names instead (trainer.sched_metric).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: Optional[LRScheduler],
                 metric: Optional[str], validates: bool) -> None:
        plateau = isinstance(scheduler, ReduceLROnPlateau)
        name = type(scheduler).__name__
        if plateau and metric is None:
            raise ConfigError(
                f"sched: {name} is stepped with a validation metric, not once per step. Set "
                f"trainer.sched_metric to the metric it should watch (e.g. val/loss), and its "
                f"mode (min or max) to match.")
        if metric is not None and not plateau:
            raise ConfigError(
                f"trainer.sched_metric={metric!r} is set, but the scheduler "
                f"({name if scheduler is not None else 'none'}) is stepped once per optimizer "
                f"step, not with a metric. Remove trainer.sched_metric, or use a "
                f"ReduceLROnPlateau.")
        if metric is not None and not validates:
            raise ConfigError(f"trainer.sched_metric={metric!r} needs validation data: the "
                              f"scheduler is stepped after each validation.")
        self.optimizer, self.scheduler, self.metric = optimizer, scheduler, metric
        self._per_step = scheduler is not None and not plateau
        self._used: Optional[list[Any]] = None  # the rates of the latest step
        self._ran, self._found_inf = False, None
        if self._per_step:
            optimizer.register_step_post_hook(self._optimizer_ran)

    def _optimizer_ran(self, optimizer: Any, *_: Any) -> None:
        self._ran = True
        # A fused optimizer under an enabled GradScaler is stepped even for inf gradients, with
        # the scaler's found_inf set on it for the step, and skips the update in its kernel.
        self._found_inf = getattr(optimizer, "found_inf", None)

    def after_step(self) -> None:
        """Once after every step of the loop, skipped or not: remember its rates, then step the
        per-step scheduler if the optimizer really stepped."""
        if self.scheduler is None:
            return  # the rates only change here: they are read at log points
        # a tensor rate is updated in place by the scheduler: keep a copy (a device op)
        self._used = [lr.clone() if isinstance(lr, torch.Tensor) else lr
                      for lr in (g["lr"] for g in self.optimizer.param_groups)]
        if self._ran:
            self._ran = False
            found, self._found_inf = self._found_inf, None
            if found is None or not found.item():  # (a host read: fused + GradScaler only)
                self.scheduler.step()

    def after_validation(self, metrics: Mapping[str, float]) -> None:
        """Step a metric-driven scheduler with the validation metric it watches."""
        if self.metric is None:
            return
        if self.metric not in metrics:
            raise ConfigError(f"trainer.sched_metric={self.metric!r}, but validation reports "
                              f"only {', '.join(metrics)}.")
        assert self.scheduler is not None
        self.scheduler.step(metrics[self.metric])  # type: ignore[arg-type]  # ReduceLROnPlateau: the metric

    def schedulers(self) -> list[Any]:
        """The scheduler, if any (for the refusal of a scheduler step in training_step)."""
        return [] if self.scheduler is None else [self.scheduler]

    def rates(self) -> dict[str, float]:
        """The learning rate the latest step used, per parameter group: `train/lr` for the
        first group, `train/lr/<name>` for a group with a 'name' key, else `train/lr/group<i>`."""
        groups = self.optimizer.param_groups
        used = self._used if self._used is not None and len(self._used) == len(groups) else [
            g["lr"] for g in groups]
        out: dict[str, float] = {}
        for i, (group, lr) in enumerate(zip(groups, used)):
            key = "train/lr" if i == 0 else f"train/lr/{group.get('name') or f'group{i}'}"
            out[key if key not in out else f"train/lr/group{i}"] = float(lr)
        return out


def check_schedule_length(scheduler: Any, max_steps: Optional[int]) -> None:
    """A schedule with a fixed number of steps (OneCycleLR's total_steps) must cover the run's
    `max_steps`: torch raises a bare ValueError at the first step past it. Several by name:
    each."""
    named = scheduler.items() if isinstance(scheduler, Mapping) else [("", scheduler)]
    for name, sched in named:
        total = getattr(sched, "total_steps", None)
        if max_steps is None or not isinstance(total, int) or total >= max_steps:
            continue
        which = f"the scheduler of optimizer {name!r} ({type(sched).__name__})" if name else \
            f"sched ({type(sched).__name__})"
        raise ConfigError(
            f"{which} has total_steps={total}, fewer than the run's {max_steps} steps "
            f"(trainer.max_steps, or max_epochs times the steps per epoch): it cannot step past "
            f"step {total}. Size it by the run, sched.total_steps: ${{trainer.max_steps}} (then a "
            f"longer run is a new run or a forced resume), or lower the run's limits.")


Hyperparameters = tuple[list[dict[str, Any]], Optional[dict[str, Any]]]


class NamedSchedules:
    """One `Schedule` per optimizer; the rates are logged as `train/lr/<name>` (and
    `train/lr/<name>/<group>` for its other parameter groups)."""

    def __init__(self, optimizers: Mapping[str, torch.optim.Optimizer],
                 schedulers: Mapping[str, Any], metric: Optional[str], validates: bool) -> None:
        plateaus = [n for n, s in schedulers.items() if isinstance(s, ReduceLROnPlateau)]
        if metric is not None and not plateaus:
            raise ConfigError(f"trainer.sched_metric={metric!r} is set, but no optimizer's "
                              f"scheduler is a ReduceLROnPlateau. Remove trainer.sched_metric.")
        self.by_name = {name: Schedule(opt, schedulers.get(name),
                                       metric if name in plateaus else None, validates)
                        for name, opt in optimizers.items()}

    def schedulers(self) -> list[Any]:
        return [s for schedule in self.by_name.values() for s in schedule.schedulers()]

    def after_step(self) -> None:
        for schedule in self.by_name.values():
            schedule.after_step()

    def after_validation(self, metrics: Mapping[str, float]) -> None:
        for schedule in self.by_name.values():
            schedule.after_validation(metrics)

    def rates(self) -> dict[str, float]:
        return {key.replace("train/lr", f"train/lr/{name}", 1): lr
                for name, schedule in self.by_name.items() for key, lr in schedule.rates().items()}


def configured_hyperparameters(optimizer: Any, scheduler: Any) -> Any:
    """The freshly built optimizer's param-group settings and scheduler state (copies), for a
    forced resume that changes them (see `use_configured_hyperparameters`). Several named
    optimizers (a mapping, loop/optimizers.py): {name: the same, for that optimizer}."""
    if isinstance(optimizer, Mapping):
        return {name: _configured(opt, (scheduler or {}).get(name), f" (optimizer {name!r})")
                for name, opt in optimizer.items()}
    return _configured(optimizer, scheduler)


def _configured(optimizer: torch.optim.Optimizer, scheduler: Optional[LRScheduler],
                which: str = "") -> Hyperparameters:
    if isinstance(scheduler, ReduceLROnPlateau):
        raise ConfigError(
            f"force_resume with a changed optim or sched cannot apply them to a ReduceLROnPlateau "
            f"schedule{which}: its rate depends on the validation history, which a new config "
            f"cannot replay. Keep the checkpoint's optim and sched values, or start a new run.")
    groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
              for g in optimizer.param_groups]
    return groups, copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None


def use_configured_hyperparameters(optimizer: Any, scheduler: Any, configured: Any,
                                   saved: Optional[Mapping[str, Any]], steps: int) -> None:
    """After loading a checkpoint: the configured settings with the checkpoint's moments.

    Loading an optimizer's state also restores its learning rate and other settings, and a
    scheduler's state its base learning rates. For a forced resume with a new optim or sched
    config, put back the configured ones, and advance the configured schedule as many times
    as the checkpoint's scheduler (`saved`, its state) was stepped (replaying it, so that any
    schedule works; `steps`, the loop's, where the checkpoint had no scheduler): the learning
    rate is then the one a run configured this way from the start would have at this step.
    Each schedule counts its own steps: an optimizer whose update was dropped (a skip policy,
    GradScaler) did not step its scheduler. Several named optimizers: each by name.
    """
    if isinstance(optimizer, Mapping):
        named = (saved or {}).get("named", {})  # loop/optimizers.py NAMED
        for name, opt in optimizer.items():
            _use_configured(opt, (scheduler or {}).get(name), configured[name], named.get(name),
                            steps)
        return
    _use_configured(optimizer, scheduler, configured, saved, steps)


def _use_configured(optimizer: torch.optim.Optimizer, scheduler: Optional[LRScheduler],
                    configured: Hyperparameters, saved: Optional[Mapping[str, Any]],
                    steps: int) -> None:
    groups, schedule = configured
    for group, fresh in zip(optimizer.param_groups, groups):
        params = group["params"]
        group.clear()
        group.update(copy.deepcopy(fresh), params=params)
    if scheduler is None or schedule is None:
        return
    scheduler.load_state_dict(copy.deepcopy(schedule))
    with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": intended
        warnings.simplefilter("ignore")
        for _ in range((saved or {}).get("last_epoch", steps)):
            scheduler.step()
