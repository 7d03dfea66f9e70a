"""May this run resume that checkpoint? The config keys whose change would make a resumed run
differ from the uninterrupted one, compared with the checkpoint's config."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from ..config import GuardsConfig, TrainerConfig, resolved_with_limits
from ..errors import ConfigError
from ..guards.policies import POLICIES


# Keys whose change makes a resumed run differ from the uninterrupted one.
EXACTNESS_KEYS = ("seed", "model", "data", "collate_fn", "task", "optim", "sched",
                  "trainer.batch_size",
                  "trainer.accumulate", "trainer.num_workers", "trainer.shuffle",
                  "trainer.drop_last", "trainer.precision", "trainer.frozen_modules",
                  "trainer.max_grad_norm", "trainer.sched_metric", "trainer.ema",
                  "guards.nonfinite", "guards.spikes",  # which steps are skipped or rolled back
                  # which steps validate, on which batches: that steers ReduceLROnPlateau,
                  # EarlyStopping and save_best
                  "trainer.val_every_n_steps", "trainer.limit_val_batches",
                  "trainer.val_batch_size")
# Under a spike policy that drops steps (skip, rollback), which steps are spikes.
SPIKE_KEYS = ("guards.spike_window", "guards.spike_threshold", "guards.spike_warmup")
_FORCE = "Restore those values, or set force_resume=true to continue anyway."


def check_resume_config(saved: Mapping[str, Any], current: Mapping[str, Any], force: bool,
                        keys: tuple[str, ...] = EXACTNESS_KEYS, purpose: str = "resume exactly",
                        against: str = "the checkpoint's", remedy: str = _FORCE) -> None:
    """Refuse to resume when `current` differs from the checkpoint's config in `keys`
    (and in SPIKE_KEYS when the guards' spike policy is checked and either config skips or
    rolls back spikes). `against` names whose config `saved` is, `remedy` what to do."""
    # a trainer or guards key the checkpoint's saferun did not know yet had its default there
    known = {"trainer": dataclasses.asdict(TrainerConfig()), "guards": dataclasses.asdict(GuardsConfig())}
    old = {**_flatten(known), **_flatten(saved)}
    new = _flatten(current)
    if "guards.spikes" in keys and \
            any(POLICIES[p].drops_steps for p in {old.get("guards.spikes"), new.get("guards.spikes")}
                if p in POLICIES):
        keys += SPIKE_KEYS
    changed = sorted(k for k in set(old) | set(new)
                     if k.startswith(keys) and old.get(k, "<absent>") != new.get(k, "<absent>"))
    if not changed or force:
        return
    listed = "; ".join(f"{k}: {old.get(k, '<absent>')!r} -> {new.get(k, '<absent>')!r}" for k in changed)
    raise ConfigError(f"cannot {purpose}: the config differs from {against} in {listed}. {remedy}")


def check_second_fit(given: Any, built: Mapping[str, Any], current: Mapping[str, Any],
                     step: int, checkpoint: Any) -> None:
    """A second fit() on a Trainer continues the first's run: refused, as a resume through
    `checkpoint` (the newest, or None) would be, when the config it would build now differs
    from the one the first fit() `built` the run with. `given` is the config as the Trainer was
    given it (None: a Config, nothing left to resolve): a node that interpolates the run's
    limits (a schedule sized by `${trainer.max_steps}`) resolves anew with the raised limits."""
    now = dict(current)
    if given is not None:
        first, later = resolved_with_limits(given, built["trainer"]), \
            resolved_with_limits(given, current["trainer"])
        now.update({k: v for k, v in later.items()
                    if k not in ("trainer", "guards") and v != first[k]})
    limits = ", ".join(f"trainer.{k}={current['trainer'][k]}" for k in ("max_steps", "max_epochs")
                       if current["trainer"][k] is not None)
    resume = (f"resume from its newest checkpoint ({checkpoint}) in a new Trainer configured so, "
              f"with force_resume=true (the configured values apply from step {step}, the "
              f"optimizer's moments are the checkpoint's)" if checkpoint is not None else
              "save checkpoints (trainer.save_every_n_steps) to continue a run on new values")
    # A schedule sized for the run's length cannot be stretched exactly: the steps taken so far
    # used the shorter schedule's rates, so only one run of the new length from step 0 equals it.
    check_resume_config(built, now, force=False, purpose="continue the run in a second fit()",
                        against="the one the first fit() built the run with",
                        remedy=f"The steps so far ({step}) followed those values. For one run with "
                               f"{limits or 'the new limits'} from the start, build a new Trainer; "
                               f"to go on from step {step} with the new values, {resume}.")


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, Mapping):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out if out or not prefix else {prefix[:-1]: {}}
    return {prefix[:-1]: node}
