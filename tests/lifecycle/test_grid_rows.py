"""Every stateful component the Trainer holds has a row in the lifecycle grid (grid.py): the
parts a checkpoint holds (StatefulParts), every callback or logger saferun ships that keeps
state or writes files, every schedule a config can name, and the sweep's study and summary.
A new component fails here until the grid has a row for it (or a stated reason it needs none)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
from pathlib import Path

import yaml

import saferun
from grid import ROWS, cells
from saferun.callbacks import Callback
from saferun.checkpoint.checkpointer import StatefulParts

# StatefulParts field -> the grid row whose cells compare it (or why it is no component)
PARTS = {
    "model": "checkpoint", "optimizer": "checkpoint", "scaler": "checkpoint",
    "batches": "checkpoint",  # the data position and RNG states: the final checkpoint's loop
    "scheduler": "scheduler", "ema": "ema",
    "running": "metrics.jsonl",  # the log window not yet logged: the logged values
    "callbacks": "callback classes: see CALLBACKS",
    "strategy": "no state of its own: gathers and formats the others (the two_ranks event)",
    "stop_signals": "no state of its own: a stop's save (the sigterm event)",
    "spikes": "spikes",
}
# every saferun Callback class that keeps state (state_dict) or writes a run's files
CALLBACKS = {
    "saferun.loggers.MetricsJsonl": "metrics.jsonl",
    "saferun.loggers.TensorBoardLogger": "tensorboard scalars",
    "saferun.loggers.trackers.MLflowLogger": "mlflow",
    "saferun.loggers.trackers.WandbLogger": "wandb",
    "saferun.stopping.EarlyStopping": "early stopping",
    "saferun.callbacks.CallbackList": "no state of its own: each callback's, by name",
}
SCHEDULES = {"saferun.schedules.warmup_cosine": "scheduler",
             "torch.optim.lr_scheduler.ReduceLROnPlateau": "plateau"}
SWEEP = {"saferun.sweep.study": "optuna study", "saferun.sweep.summary": "sweep summary"}
ROOT = Path(saferun.__file__).parent
CONF = Path(__file__).parents[2] / "conf"  # the configs saferun ships


def saferun_callbacks() -> set[str]:
    """Every Callback class defined in saferun that has state or files: its own state_dict,
    or a logger a config can name."""
    named = {node["_target_"] for path in CONF.glob("*/*.yaml") if path.parent.name in
             ("logger", "callbacks") for node in (yaml.safe_load(path.read_text()) or {}).values()
             if isinstance(node, dict) and "_target_" in node}
    found = set(named)
    for info in pkgutil.walk_packages([str(ROOT)], "saferun."):
        if info.name.startswith(("saferun.cli", "saferun.__main__")):
            continue
        module = importlib.import_module(info.name)
        for name, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == info.name and Callback in cls.__mro__[1:] and \
                    cls.state_dict is not Callback.state_dict:
                found.add(f"{info.name}.{name}")
    return found


def test_every_part_a_checkpoint_holds_has_a_row():
    fields = {f.name for f in dataclasses.fields(StatefulParts)}
    assert fields == set(PARTS), (f"StatefulParts has parts the lifecycle grid does not know: "
                                  f"{sorted(fields - set(PARTS))} (add a row to tests/lifecycle/grid.py "
                                  f"and its cells); gone: {sorted(set(PARTS) - fields)}")
    assert {r for r in PARTS.values() if r in ROWS} <= {r for r, _ in cells()}


def test_every_stateful_callback_and_logger_has_a_row():
    found = saferun_callbacks()
    missing = sorted(found - set(CALLBACKS))
    assert not missing, (f"stateful callbacks or loggers without a row in the lifecycle grid: "
                         f"{missing}: add a row to tests/lifecycle/grid.py (its view in test_grid.py)")
    rows = {r for r, _ in cells()}
    assert all(r in rows or r.startswith("no state") for r in CALLBACKS.values())


def test_every_schedule_a_config_names_and_the_sweep_have_rows():
    named = {yaml.safe_load(p.read_text()).get("_target_") for p in (CONF / "sched").glob("*.yaml")}
    named.discard(None)
    shipped = {f"saferun.schedules.{n}" for n, f in inspect.getmembers(importlib.import_module(
        "saferun.schedules"), inspect.isfunction) if "total_steps" in inspect.signature(f).parameters}
    missing = sorted((named | shipped) - set(SCHEDULES))
    assert not missing, f"schedules without a row in the lifecycle grid: {missing}"
    sweep = {f"saferun.sweep.{i.name}" for i in pkgutil.iter_modules([str(ROOT / "sweep")])}
    stateful = {m for m in sweep if "study" in m or "summary" in m}
    assert stateful <= set(SWEEP), sorted(stateful - set(SWEEP))
    rows = {r for r, _ in cells()}
    assert set(SCHEDULES.values()) | set(SWEEP.values()) <= rows
