"""The closest valid config key to a misspelt one, for config errors and the command line."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
from typing import Optional, Sequence


def typed_nodes(schema: type) -> dict[str, type]:
    """The fields of `schema` (saferun.Config) that are dataclasses themselves: trainer, guards."""
    found: dict[str, type] = {}
    for f in dataclasses.fields(schema):
        factory = f.default_factory  # type: ignore[misc]
        if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory):
            found[f.name] = factory
    return found  # type: ignore[return-value]


def typed_keys(schema: type) -> list[str]:
    """Every key the schema types: the top-level fields, and trainer.* and guards.*."""
    keys = [f.name for f in dataclasses.fields(schema)]
    for node, cls in typed_nodes(schema).items():
        keys += [f"{node}.{f.name}" for f in dataclasses.fields(cls)]
    return keys


# Names other frameworks (Lightning, Hugging Face, plain scripts) give to what saferun calls
# by another name: a key ending in one is pointed at saferun's.
_HABITS_OF = {
    "optim": ("optimizer", "optimizers"), "sched": ("scheduler", "lr_scheduler"),
    "trainer.max_epochs": ("num_train_epochs", "epochs", "max_epoch", "num_epochs"),
    "trainer.max_steps": ("max_iters", "num_steps"),
    "sched.warmup_steps": ("warmup", "num_warmup_steps", "warmup_iters"),
    "optim.lr": ("learning_rate",),
    "trainer.max_grad_norm": ("gradient_clip_val", "clip_grad_norm", "grad_clip"),
    "trainer.accumulate": ("accumulate_grad_batches", "gradient_accumulation_steps"),
    "trainer.batch_size": ("per_device_train_batch_size", "train_batch_size"),
    "trainer.val_batch_size": ("per_device_eval_batch_size", "eval_batch_size"),
    "trainer.log_every_n_steps": ("logging_steps",),
    "trainer.val_every_n_steps": ("eval_steps", "val_check_interval"),
    "trainer.save_every_n_steps": ("save_steps",),
    "trainer.num_workers": ("dataloader_num_workers",), "trainer.device": ("accelerator",),
    "logger": ("loggers",), "callbacks": ("callback",),
}
HABITS = {habit: ours for ours, habits in _HABITS_OF.items() for habit in habits}


def did_you_mean(key: str, schema: type) -> str:
    """' Did you mean trainer.max_steps?' for the valid key of `schema` (saferun.Config) closest
    to `key`, or '' when none is close: a wrong suggestion misleads more than none. (The schema
    is passed in: config.py imports this module.)"""
    parts = key.split(".")
    fields = [f.name for f in dataclasses.fields(schema)]
    nodes = typed_nodes(schema)
    if parts[-1] in HABITS:  # trainer.num_train_epochs: trainer.max_epochs; optimizer: optim
        return f" Did you mean {HABITS[parts[-1]]}?"
    if parts[0] not in fields:
        top = difflib.get_close_matches(parts[0], fields, n=1, cutoff=0.75)
        if top:  # a misspelt first part: the closest node, with the rest if valid
            rest = ".".join(parts[1:2])
            valid = top[0] in nodes and rest in {f.name for f in dataclasses.fields(nodes[top[0]])}
            return f" Did you mean {top[0]}.{rest}?" if valid else f" Did you mean {top[0]}?"
    # Else the key's last part against the last part of every known key: in the same node
    # first (trainer.max_stepz), then anywhere (lr -> optim.lr, max_steps -> trainer.max_steps).
    last, known = parts[-1], known_keys(schema)
    for pool in ([k for k in known if k.split(".")[0] == parts[0]], known):
        ends = {k.rsplit(".", 1)[-1]: k for k in reversed(pool) if k != key}
        found = difflib.get_close_matches(last, list(ends), n=1, cutoff=0.8)
        if found and found[0] == last:  # the right name in the wrong place: say where it goes
            place = f"under {ends[last].rsplit('.', 1)[0]}" if "." in ends[last] else "at the top level"
            given = f"under {'.'.join(parts[:-1])}" if len(parts) > 1 else "at the top level"
            return f" Did you mean {ends[last]}? '{last}' is a key {place}, not {given}."
        if found:
            return f" Did you mean {ends[found[0]]}?"
    return ""


def known_keys(schema: type) -> list[str]:
    """The typed keys, and the arguments of the shipped optim and sched options (optim.lr,
    sched.warmup_steps): what a user may mean by a key the schema does not have."""
    import yaml

    keys = typed_keys(schema)
    conf = importlib.resources.files("saferun.conf")
    for group in ("optim", "sched"):
        for option in sorted(conf.joinpath(group).iterdir(), key=lambda p: p.name):
            text = option.read_text() if option.name.endswith(".yaml") else ""
            node = yaml.safe_load(text) or {}
            if "# @package _global_" in text:  # sched/constant.yaml: `sched: null`
                node = node.get(group) or {}
            keys += [f"{group}.{k}" for k in node if not k.startswith("_") and f"{group}.{k}" not in keys]
    return keys


def unknown_override(args: Sequence[str], schema: type, config_dirs: Sequence[str] = ()
                     ) -> Optional[str]:
    """The first command-line override `key=value` whose key the schema cannot have, with the
    closest valid key; None if all may be valid. Only keys that are certainly wrong are
    named: a misspelt trainer.* or guards.* field, or a first part that is neither a config
    field nor a config group (the free nodes, optim.*, model.*, ..., are checked by their
    `_target_`'s signature later)."""
    fields = {f.name for f in dataclasses.fields(schema)}
    groups = _group_names(config_dirs)
    typed = typed_nodes(schema)
    for arg in args:
        if "=" not in arg or arg.startswith(("-", "~", "++")):
            continue
        key = arg.split("=", 1)[0].lstrip("+").split("@", 1)[0]
        parts = key.split(".")
        if parts[0].split("/")[0] == "hydra":  # hydra.key=value and hydra/group=option: Hydra's
            continue
        if parts[0] in typed and len(parts) > 1:
            known = {f.name for f in dataclasses.fields(typed[parts[0]])}
            if parts[1] in known:
                continue
        elif parts[0] in fields or parts[0] in groups:
            continue
        return (f"unknown config key '{key}' in the override '{arg}'.{did_you_mean(key, schema)} "
                f"(Hydra's '+{key}' would add a key that saferun's schema refuses; "
                f"`saferun run --cfg job` prints every key.)")
    return None


def _group_names(config_dirs: Sequence[str]) -> set[str]:
    import os

    names = {p.name for p in importlib.resources.files("saferun.conf").iterdir() if p.is_dir()}
    for d in config_dirs:
        if os.path.isdir(d):
            names |= {n for n in os.listdir(d) if os.path.isdir(os.path.join(d, n))}
    return names
