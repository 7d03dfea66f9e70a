"""The grid's sweep rows: the Optuna study and the sweep summary, through a sweep of 4 trials
in one go and a sweep of 2 continued to 4 (a rerun with the same hydra.sweep.dir)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

FAST = ["recipe=tabular", "debug=fast", "trainer.progress_bar=false", "trainer.max_steps=4",
        "trainer.val_every_n_steps=4", "hydra/sweeper=optuna",
        "optim.lr=tag(log,interval(1e-4,1e-2))", "trainer.batch_size=range(16,65,16)"]


def sweep(cwd: Path, trials: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("SAFERUN_RUN_ID", None)
    proc = subprocess.run([sys.executable, "-m", "saferun", "run", "-m", *FAST,
                           f"hydra.sweeper.n_trials={trials}", "hydra.sweep.dir=sweep"],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def sweep_event(runs: Any, name: str) -> Path:
    cwd = runs.root / name
    if not cwd.exists():
        cwd.mkdir()
        if name == "sweep_continued":
            sweep(cwd, 2)
            sweep(cwd, 4)
        else:
            sweep(cwd, 4)
    return cwd / "sweep"


def study(folder: Path) -> list[tuple[int, str, dict[str, Any], Any]]:
    import optuna

    loaded = optuna.load_study(study_name="saferun", storage=f"sqlite:///{folder}/optuna.db")
    return [(t.number, t.state.name, t.params, t.value) for t in loaded.trials]


def summary(folder: Path) -> dict[str, Any]:
    results = yaml.safe_load((folder / "optimization_results.yaml").read_text())
    jobs = {p.name: json.loads((p / "summary.json").read_text())["objective"]["value"]
            for p in folder.iterdir() if (p / "summary.json").is_file()}
    return {"best_trial": results["best_trial"], "best_value": results["best_value"],
            "jobs": jobs, "table": len((folder / "summary.txt").read_text().splitlines())}


def check_sweep(row: str, event: str, runs: Any) -> None:
    folder = sweep_event(runs, event)
    trials = study(folder)
    if row == "optuna study":
        assert [(n, s) for n, s, _, _ in trials] == [(i, "COMPLETE") for i in range(4)], trials
        points = [tuple(sorted(p.items())) for _, _, p, _ in trials]
        assert len(set(points)) == 4, f"a trial's parameters drawn again: {points}"
        if event == "sweep_uninterrupted":  # the continued sweep draws as one sweep of 4 does
            assert trials == study(sweep_event(runs, "sweep_continued"))
    else:
        got = summary(folder)
        values = {str(n): v for n, _, _, v in trials}
        assert got["jobs"] == values  # every job, its objective as the study holds it
        best = min(values, key=lambda n: values[n])
        assert (str(got["best_trial"]), got["best_value"]) == (best, values[best])
        if event == "sweep_uninterrupted":
            assert got == summary(sweep_event(runs, "sweep_continued"))
