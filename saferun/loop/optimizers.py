"""Several named optimizers: the containers the Trainer holds in `optimizer` and `scheduler`
when `build_optimizer` returns `{name: optimizer}`, and the checks made when they are built.

The containers answer what the rest of saferun asks of one optimizer and one scheduler
(`state_dict`, `load_state_dict`, `zero_grad`, `param_groups`, `step`), so checkpoints,
rollback and a forced resume handle every optimizer by name. The step that drives them is
`loop/manual.py`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Iterator, Optional

import torch
from torch import nn

from ..errors import CheckpointError, ConfigError, SaferunError
from ..schedules import NamedSchedules
from ..text import short
from .steps import check_optimizer_params

NAMED = "named"  # the key that marks a state dict of several optimizers or schedulers


class _Named(Mapping):
    """`{name: object}` in the order `build_optimizer` gave them, checkpointed by name."""

    kind = ""  # "optimizer" or "scheduler": the messages of a resume whose names differ

    def __init__(self, by_name: Mapping[str, Any]) -> None:
        self._by_name = dict(by_name)

    def __getitem__(self, name: str) -> Any:
        return self._by_name[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    def state_dict(self) -> dict[str, Any]:
        return {NAMED: {name: obj.state_dict() for name, obj in self._by_name.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = _named_state(state, self.kind)
        check_same_names(self.kind, list(saved), list(self._by_name))
        for name, obj in self._by_name.items():
            obj.load_state_dict(saved[name])


class NamedOptimizers(_Named):
    """`{name: optimizer}` in the order `build_optimizer` gave them."""

    kind = "optimizer"

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every optimizer's parameter groups, in name order (the groups themselves, not copies)."""
        return [g for opt in self._by_name.values() for g in opt.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self._by_name.values():
            opt.zero_grad(set_to_none=set_to_none)


class NamedSchedulers(_Named):
    """`{name: scheduler}` for the optimizers that have one."""

    kind = "scheduler"

    def step(self) -> None:  # a forced resume replays the schedules with it
        for scheduler in self._by_name.values():
            scheduler.step()


def build_named(trainer: Any, optimizers: Mapping[str, Any], model: nn.Module
                ) -> tuple[NamedOptimizers, Optional[NamedSchedulers], NamedSchedules]:
    """Check `build_optimizer`'s `{name: optimizer}` and build the schedules: (optimizers,
    schedulers or None, schedules). Refuses what cannot be right, saying why."""
    named = NamedOptimizers(optimizers)
    check_named(named, model)
    check_config(trainer.cfg)
    # build_scheduler(optimizer) is called once per optimizer (the default: the `sched` node
    # for each); `trainer.optimizer` is still build_optimizer's dict, to tell them apart.
    schedulers = NamedSchedulers({name: s for name, s in (
        (name, trainer.build_scheduler(opt)) for name, opt in named.items()) if s is not None})
    t = trainer.cfg.trainer
    schedules = NamedSchedules(named, schedulers, t.sched_metric, trainer.val_loader is not None)
    return named, (schedulers if len(schedulers) else None), schedules


def check_named(named: NamedOptimizers, model: nn.Module) -> None:
    """Names are non-empty strings; each optimizer is one; see `check_held`."""
    if not named:
        raise SaferunError("build_optimizer returned an empty dict: name at least one optimizer.")
    for name, opt in named.items():
        if not isinstance(name, str) or not name or "/" in name:
            raise SaferunError(f"build_optimizer: optimizer names must be non-empty strings "
                               f"without '/' (they name log keys); got {name!r}.")
        if not isinstance(opt, torch.optim.Optimizer):
            raise SaferunError(f"build_optimizer: {name!r} is a {type(opt).__name__}, not a "
                               f"torch.optim.Optimizer.")
        check_optimizer_params(opt, model, name)
    check_held(named, model)
    check_some_trainable(named, model)


def check_some_trainable(named: NamedOptimizers, model: nn.Module) -> None:
    """Each of several optimizers holds a parameter trainable now: its optimize() backpropagates
    into those only (loop/manual.py), so one over frozen parameters alone would train nothing."""
    names = {id(p): n for n, p in model.named_parameters()}
    for name, opt in named.items():
        held = [p for g in opt.param_groups for p in g["params"]]
        if held and not any(p.requires_grad for p in held):
            raise SaferunError(
                f"build_optimizer: {name!r} holds only frozen parameters (requires_grad=False "
                f"when training starts: {short([names[id(p)] for p in held])}), so its "
                f"optimize() would train nothing. Each optimizer trains the parameters it holds "
                f"that are trainable when fit() starts: one switched on only inside "
                f"training_step (a GAN's discriminator, on for its own optimize()) is never "
                f"updated. Leave them trainable in build_model (switching them off for the other "
                f"losses inside training_step is harmless: each optimize() backpropagates into "
                f"its own optimizer's parameters only), or drop {name!r}.")


def check_held(optimizers: Mapping[str, torch.optim.Optimizer], model: nn.Module) -> None:
    """What the optimizers hold against what the model trains, whatever the optimizer class:
    every parameter they hold is the model's (not a copy's, not another model's), each
    trainable parameter is in exactly one optimizer, and no parameter group is empty (a filter
    by name that matched nothing). `optimizers`: {name: optimizer}; "" names the only one."""
    owner: dict[int, str] = {}
    in_model = {id(p) for p in model.parameters()}
    for name, opt in optimizers.items():
        what = repr(name) if name else "the optimizer"
        for i, group in enumerate(opt.param_groups):
            if not group["params"]:
                settings = {k: v for k, v in group.items() if k in ("lr", "weight_decay")}
                raise SaferunError(
                    f"build_optimizer: {what}'s parameter group {i} ({settings}) holds no "
                    f"parameter: the filter that chose its parameters (by name or type, e.g. "
                    f"norms and biases without weight decay) matched none of the model's, so its "
                    f"settings apply to nothing. Check the names against "
                    f"[n for n, _ in model.named_parameters()].")
            for p in group["params"]:
                if id(p) not in in_model:
                    raise SaferunError(
                        f"build_optimizer: {what} holds a parameter of shape {tuple(p.shape)} "
                        f"that is not in the model (another model's, or a copy's): stepping it "
                        f"does not change the model that trains, checkpoints would not hold its "
                        f"value and a resume would not restore it. Build the optimizer from "
                        f"build_optimizer's params argument (or self.model's parameters).")
                if owner.setdefault(id(p), name) != name:
                    raise SaferunError(
                        f"build_optimizer: parameter '{_name_of(p, model)}' is in both "
                        f"{owner[id(p)]!r} and {name!r}. Each optimize(name, loss) steps only its "
                        f"own optimizer's parameters, so a shared one would be updated twice per "
                        f"step with gradients of different losses. Give each parameter to one "
                        f"optimizer.")
    orphans = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in owner]
    if orphans:
        holders = ", ".join(n for n in optimizers if n) or "the optimizer"
        raise SaferunError(
            f"build_optimizer: trainable parameter(s) {', '.join(orphans[:8])}"
            f"{f' ({len(orphans)} in all)' if len(orphans) > 8 else ''} are in no optimizer "
            f"({holders}), so they get gradients but never train. Add them to one, or freeze "
            f"them (trainer.frozen_modules).")


def check_config(cfg: Any) -> None:
    """The settings that cannot be right with several optimizers driven by training_step."""
    t, g = cfg.trainer, cfg.guards
    refusals = {
        "trainer.accumulate": (t.accumulate > 1,
            f"is {t.accumulate}: with several optimizers each optimize() steps at once, so a "
            f"later loss in the same step (the generator's, through the discriminator that just "
            f"stepped) sees the new weights; accumulated micro-batches would not equal one large "
            f"batch. Raise trainer.batch_size instead"),
        "trainer.compile": (t.compile, "is on: the compiled-against-eager check runs "
                            "training_step's single loss; not supported with several optimizers"),
        "trainer.strategy": (t.strategy in ("fsdp", "mesh"), f"is {t.strategy}: each optimize() "
                             f"averages its optimizer's gradients itself, which sharded or split "
                             f"parameters do not allow; not supported with several optimizers "
                             f"yet (use ddp)"),
        "trainer.ema": (t.ema.decay is not None, "is on: the average is updated by one "
                        "optimizer's step hook; not supported with several optimizers yet"),
        "guards.spikes": (g.spikes != "off", f"is {g.spikes}: the spike statistics are kept for "
                          f"one loss and one gradient norm; set guards.spikes=off"),
        "guards.anomaly_replay": (g.anomaly_replay, "is on: replaying a step would step the "
                                  "optimizers again; set guards.anomaly_replay=false"),
    }
    for key, (refused, why) in refusals.items():
        if refused:
            raise ConfigError(f"{key} {why} (build_optimizer returned several optimizers).")


def check_state_kind(saved: Mapping[str, Any], optimizer: Any) -> None:
    """A checkpoint of one optimizer resumed into several, or the reverse: say so."""
    several = NAMED in saved
    if several != isinstance(optimizer, NamedOptimizers):
        what = f"optimizers {', '.join(saved[NAMED])}" if several else "one optimizer"
        raise CheckpointError(
            f"the checkpoint holds {what}, but this Trainer's build_optimizer returns "
            f"{'several' if not several else 'one'}. Resume with the Trainer that wrote it, "
            f"or start a new run.")


def check_same_names(kind: str, saved: list[str], mine: list[str]) -> None:
    if sorted(saved) != sorted(mine):
        raise CheckpointError(
            f"the checkpoint's {kind}s are named {', '.join(saved) or 'none'}, this Trainer's "
            f"{', '.join(mine) or 'none'}: each state is restored by name, so a renamed, added "
            f"or removed {kind} cannot resume exactly. Keep the names, or start a new run.")


def _named_state(state: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    if NAMED not in state:
        raise CheckpointError(f"the checkpoint holds one {kind}, this Trainer has several "
                              f"(named). Resume with the Trainer that wrote it, or start a new run.")
    return state[NAMED]


def _name_of(p: torch.Tensor, model: nn.Module) -> str:
    return next((n for n, q in model.named_parameters() if q is p), "<not in the model>")


# ---------------------------------------------------------------- for `saferun check`

NO_SINGLE_LOSS = ("not checked: several optimizers (training_step updates each one itself and "
                  "returns no single loss to measure)")


def each_optimizer_moves(trainer: Any, batch: Any, steps: int) -> tuple[str, str]:
    """The one-batch check with several optimizers: their losses may be adversarial (a GAN's
    cannot all fall), so each optimizer's updates must move its parameters, its loss finite.
    Returns (status, finding)."""
    def held(name: str) -> list[torch.Tensor]:
        return [p for g in trainer.optimizer[name].param_groups for p in g["params"]]

    names = list(trainer.optimizer)
    before = {n: [p.detach().clone() for p in held(n)] for n in names}
    logs = [trainer.train_step([batch]).logs for _ in range(steps)]
    losses = {n: [float(d[f"loss/{n}"]) for d in logs] for n in names}
    still = [n for n in names if all(torch.equal(b, p) for b, p in zip(before[n], held(n)))]
    bad = [n for n in names if not all(math.isfinite(v) for v in losses[n])]
    trend = ", ".join(f"{n} {v[0]:.4g} -> {v[-1]:.4g}" for n, v in losses.items())
    if still or bad:
        return "fail", (f"on one repeated batch, optimizer(s) {', '.join(still + bad)} did not "
                        f"move their parameters or had a non-finite loss ({trend}).")
    return "pass", (f"several optimizers, each moves its parameters on one repeated batch "
                    f"(losses may be adversarial: {trend})")
