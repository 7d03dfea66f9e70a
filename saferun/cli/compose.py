"""Composing the config as `saferun run` does: Hydra's config store and search path, the run id,
and the sweep summary callback. With `cli/run.py`, the only place that sees Hydra's DictConfig."""

from __future__ import annotations

import datetime
import os
import re
import secrets
import sys
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence


def compose_config(overrides: Sequence[str] = (), config_dirs: Sequence[str] = ()) -> Any:
    """The `saferun.Config` that `saferun run OVERRIDES` would train with (no run directory)."""
    from hydra import compose, initialize_config_module

    from ..config import load_config

    _register_with_hydra()
    overrides = list(overrides)
    for config_dir in config_dirs:
        sys.path.insert(0, os.path.abspath(config_dir))
    if config_dirs:
        paths = ",".join(f"file://{os.path.abspath(d)}" for d in config_dirs)
        overrides.append(f"hydra.searchpath=[{paths}]")
    with initialize_config_module(config_module="saferun.conf", version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    return load_config(plain_config(cfg))


def kept_recipe_note(overrides: Sequence[str]) -> Optional[str]:
    """`task._target_=X` with no recipe chosen: X runs with the default recipe's settings (its
    model and data nodes, learning rate, step limits). Legitimate, but easy to miss: said."""
    sets_task = any(o.lstrip("+").startswith("task._target_=") for o in overrides)
    chooses = any(o.lstrip("~+").split("=", 1)[0] == "recipe" for o in overrides)
    if not sets_task or chooses:
        return None
    return ("task._target_ replaces the default recipe's Trainer but keeps the rest of the digits "
            "recipe (conf/recipe/digits.yaml: its model and data nodes, optim.lr, trainer.max_steps "
            "and the other trainer keys it sets). To start from saferun's defaults instead, "
            "write ~recipe ++task._target_=... (then set model and data yourself); or name your "
            "own recipe (-cd DIR recipe=NAME); `saferun run --cfg job ...` shows the config your "
            "Trainer gets.")


def compose_problem(overrides: Sequence[str], config_dirs: Sequence[str] = ()) -> Optional[str]:
    """What Hydra's composition of `overrides` refuses (an unknown option, a key it cannot
    override, a value of the wrong type), in one line with the fix; None if it composes (or
    fails only in what the job resolves later, such as ${hydra:...})."""
    from hydra import compose, initialize_config_module
    from hydra.errors import ConfigCompositionException, MissingConfigException
    from omegaconf.errors import ValidationError

    _register_with_hydra()
    overrides = list(overrides)
    if config_dirs:
        paths = ",".join(f"file://{os.path.abspath(d)}" for d in config_dirs)
        overrides.append(f"hydra.searchpath=[{paths}]")
    try:
        with initialize_config_module(config_module="saferun.conf", version_base="1.3"):
            compose("config", overrides=overrides)
    except MissingConfigException as e:  # optim=sgdd: "Could not find 'optim/sgdd'", options below
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        options = [line for line in lines[2:] if "=" not in line and ":" not in line]
        head = lines[0].replace("In 'config': ", "")
        return f"{head}; the options: {', '.join(options)} (`saferun list` shows every group)." \
            if options else f"{head}."
    except (ConfigCompositionException, ValidationError) as e:
        cause: BaseException = e
        while cause.__cause__ is not None:
            cause = cause.__cause__
        key = getattr(cause, "full_key", None)
        text = " ".join(str(cause).split("\n    full_key")[0].split())
        refused = re.match(r"Could not override '(\w+)\.(\w+)\.([\w.]+)'", str(e))
        if refused and refused.group(1) in ("logger", "callbacks"):  # logger.wandb.mode, no wandb
            group, name, rest = refused.groups()
            return (f"{group}.{name}.{rest}: {group}.{name} is not in the config ({text}). "
                    f"Choose it first: {group}={name} {group}.{name}.{rest}=VALUE"
                    if group == "logger" else f"{group}.{name}.{rest}: there is no callback "
                    f"{name!r} ({text}); add one with +{group}.{name}._target_=CLASS.")
        return f"{key}: {text}" if key else f"{str(e).splitlines()[0]} {text}"
    return None


def plain_config(cfg: Any) -> dict[str, Any]:
    """The composed config as plain data. Its logger set is whole: `logger.NAME=null` has
    removed NAME from it, so the None entries go (in Python, a None edits the defaults)."""
    from omegaconf import OmegaConf

    plain: Any = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(plain, dict)
    plain["logger"] = {k: v for k, v in (plain.get("logger") or {}).items() if v is not None}
    return plain


def _register_with_hydra() -> None:
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from ..config import Config

    schema = OmegaConf.structured(Config)
    # The defaults list's logger group fills `logger` (logger=none: nothing). Left at Config's
    # default, TensorBoard would survive the merge of logger=none's empty mapping.
    schema.logger = {}
    ConfigStore.instance().store(name="saferun_schema", node=schema)
    if not OmegaConf.has_resolver("saferun_run_id"):
        OmegaConf.register_new_resolver("saferun_run_id", run_id, use_cache=True)


_RUN_ID: Optional[str] = None
_GENERATED = False  # the id was made up here: a directory named with it is new, this run's


def run_id() -> str:
    """The run's id: $SAFERUN_RUN_ID if set (so all ranks of a torchrun job agree), else
    a timestamp with a random suffix, fixed for the life of this process."""
    global _RUN_ID, _GENERATED
    if _RUN_ID is None:
        _GENERATED = not os.environ.get("SAFERUN_RUN_ID")
        _RUN_ID = os.environ.get("SAFERUN_RUN_ID") or (
            datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S") + "_" + secrets.token_hex(2))
    return _RUN_ID


def generated_part(run_dir: str) -> Optional[Path]:
    """The part of `run_dir` (itself or a parent) that `run_id` made up for this run (not
    $SAFERUN_RUN_ID): runs/<name>/<id>, or a sweep's runs/<name>/multirun-<id>; else None."""
    if not _GENERATED or _RUN_ID is None:
        return None
    path = Path(run_dir)
    return next((p for p in (path, *path.parents) if _RUN_ID in p.name), None)


def _config_dirs(args: list[str]) -> tuple[list[str], list[str]]:
    """Hydra's `-cd DIR` / `--config-dir DIR` / `--config-dir=DIR` arguments: (dirs, the rest)."""
    dirs, rest = [], []
    args_iter = iter(args)
    for arg in args_iter:
        if arg in ("-cd", "--config-dir"):
            dirs.append(next(args_iter, ""))
        elif arg.startswith("--config-dir="):
            dirs.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
    return [d for d in dirs if d], rest


# Hydra's flags (`saferun run --hydra-help`) and the values each takes: 0, 1, or "?" (one of
# its choices if the next word is one).
HYDRA_FLAGS: dict[str, Any] = {
    **dict.fromkeys(["-h", "--help", "--hydra-help", "--version", "--resolve", "-r", "--run", "-m",
                     "--multirun", "-sc", "--shell-completion"], 0),
    **dict.fromkeys(["-c", "--cfg", "-p", "--package", "-cp", "--config-path", "-cn",
                     "--config-name", "-cd", "--config-dir", "--experimental-rerun"], 1),
    "-i": "?", "--info": "?"}
_INFO = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")


def flags_first(args: Sequence[str], command: str, flags: Mapping[str, Any] = HYDRA_FLAGS
                ) -> tuple[list[str], Optional[str]]:
    """The arguments with the flags (and their values) before the overrides, as Hydra's parser
    needs them (an override after `--cfg job` is 'unrecognized' there); and the problem with
    the first word that is neither a known flag nor an override, naming the override meant
    (`--resume`: resume=auto), or None."""
    head: list[str] = []
    tail: list[str] = []
    words = list(args)
    while words:
        word = words.pop(0)
        flag = word.split("=", 1)[0] if word.startswith("--") else word
        if not word.startswith("-"):
            tail.append(word)
        elif flag in flags:
            takes = flags[flag]
            head.append(word)
            if "=" not in word and words and (takes == 1 or (takes == "?" and words[0] in _INFO)):
                head.append(words.pop(0))
        else:
            value = word.split("=", 1)[1] if "=" in word else (
                words[0] if words and not words[0].startswith("-") and "=" not in words[0] else "")
            return [], (f"unknown option '{word}': saferun {command} takes overrides key=value"
                        f"{_flags_text(flags)}.{_override_meant(word, value)}")
    return head + tail, None


def _flags_text(flags: Mapping[str, Any]) -> str:
    return (" and Hydra's flags (-m, --cfg job, -cd DIR, ...: saferun run --hydra-help)"
            if "-m" in flags else f" and {', '.join(f for f in flags if f.startswith('--'))}")


def _override_meant(word: str, value: str) -> str:
    """' Did you mean resume=auto?' for `--resume`, ' ... trainer.max_steps=5?' for
    `--max_steps 5` (or `--max-steps=5`); '' when no config key is close."""
    from ..config import Config
    from ..suggest import did_you_mean, known_keys

    key = word.lstrip("-").split("=", 1)[0].replace("-", "_")
    value = value or ("auto" if key == "resume" else "VALUE")
    exact = [k for k in known_keys(Config) if k == key or k.endswith("." + key)]
    if exact:
        return f" Did you mean {exact[0]}={value}?"
    close = did_you_mean(key, Config)
    return close[:-1] + f"={value}?" if close else ""


try:
    from hydra.experimental.callback import Callback as _HydraCallback
except ImportError:  # pragma: no cover - hydra-core is a dependency
    _HydraCallback = object  # type: ignore[assignment,misc]


class SweepSummary(_HydraCallback):
    """After a multirun: summary.txt, the jobs ranked by the objective (`saferun.sweep.summary`).
    A sweep that a job's error (or Ctrl-C) stopped gets it too, from `summarize_stopped_sweep`."""

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        global _SWEEP_DIR
        _SWEEP_DIR = Path(config.hydra.sweep.dir)

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        write_sweep_summary(Path(config.hydra.sweep.dir))


_SWEEP_DIR: Optional[Path] = None  # the multirun this process started, once Hydra started it


def write_sweep_summary(sweep_dir: Path, trailer: str = "") -> None:
    """summary.txt in `sweep_dir` (and printed), with `trailer` as its last line if given."""
    from ..sweep.summary import sweep_summary

    table = sweep_summary(sweep_dir) if sweep_dir.is_dir() else None
    if table is None:
        return
    table += f"\n{trailer}" if trailer else ""
    (sweep_dir / "summary.txt").write_text(table + "\n")
    print(f"\nsaferun: sweep summary ({sweep_dir / 'summary.txt'})\n{table}", flush=True)


def summarize_stopped_sweep(failed_job: Optional[str]) -> None:
    """A job's error (or an interrupt) ended the multirun before Hydra's end: the jobs that
    finished are summarized all the same, so their results are not lost in the scroll-back."""
    if _SWEEP_DIR is None:  # stopped before any job started: nothing to summarize
        return
    where = f" at job {failed_job}" if failed_job is not None else ""
    write_sweep_summary(_SWEEP_DIR, f"the sweep stopped{where} (its error is above): the jobs "
                        "after it did not run. Fix the cause and run the sweep again.")
