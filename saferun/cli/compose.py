"""Composing the config as `saferun run` does: Hydra's config store and search path, the run id,
and the sweep summary callback. With `cli/run.py`, the only place that sees Hydra's DictConfig."""

from __future__ import annotations

import datetime
import os
import secrets
import sys
from pathlib import Path
from typing import Any, Optional, Sequence


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


try:
    from hydra.experimental.callback import Callback as _HydraCallback
except ImportError:  # pragma: no cover - hydra-core is a dependency
    _HydraCallback = object  # type: ignore[assignment,misc]


class SweepSummary(_HydraCallback):
    """After a multirun: summary.txt, the jobs ranked by the objective (`saferun.sweep.summary`)."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        from ..sweep.summary import sweep_summary

        sweep_dir = Path(config.hydra.sweep.dir)
        table = sweep_summary(sweep_dir) if sweep_dir.is_dir() else None
        if table is None:
            return
        (sweep_dir / "summary.txt").write_text(table + "\n")
        print(f"\nsaferun: sweep summary ({sweep_dir / 'summary.txt'})\n{table}", flush=True)
