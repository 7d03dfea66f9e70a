"""May this run resume that checkpoint? The config keys whose change would make a resumed run
differ from the uninterrupted one, compared with the checkpoint's config."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from ..config import GuardsConfig, TrainerConfig
from ..errors import ConfigError


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


def check_resume_config(saved: Mapping[str, Any], current: Mapping[str, Any], force: bool,
                        keys: tuple[str, ...] = EXACTNESS_KEYS, purpose: str = "resume exactly"
                        ) -> None:
    """Refuse to resume when `current` differs from the checkpoint's config in `keys`
    (and in SPIKE_KEYS when the guards' spike policy is checked and either config skips or
    rolls back spikes)."""
    # a trainer or guards key the checkpoint's saferun did not know yet had its default there
    known = {"trainer": dataclasses.asdict(TrainerConfig()), "guards": dataclasses.asdict(GuardsConfig())}
    old = {**_flatten(known), **_flatten(saved)}
    new = _flatten(current)
    if "guards.spikes" in keys and \
            {old.get("guards.spikes"), new.get("guards.spikes")} & {"skip", "rollback"}:
        keys += SPIKE_KEYS
    changed = sorted(k for k in set(old) | set(new)
                     if k.startswith(keys) and old.get(k, "<absent>") != new.get(k, "<absent>"))
    if not changed or force:
        return
    listed = "; ".join(f"{k}: {old.get(k, '<absent>')!r} -> {new.get(k, '<absent>')!r}" for k in changed)
    raise ConfigError(f"cannot {purpose}: the config differs from the checkpoint's in {listed}. "
                      f"Restore those values, or set force_resume=true to continue anyway.")


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, Mapping):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out if out or not prefix else {prefix[:-1]: {}}
    return {prefix[:-1]: node}
