"""What the recipe tests share: the real CLI in a subprocess, the composed config, the golden-loss
test (saferun.testing, as in the projects `saferun new` writes), a loss recorder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

from hydra.utils import get_class

import saferun
from saferun import testing
from saferun.cli import compose_config
from saferun.cli.project import GOLDEN_OVERRIDES, TEST_OVERRIDES, corpus_text, golden_file


def saferun_run(*overrides: str, run_dir: Path, timeout: int) -> subprocess.CompletedProcess:
    """`saferun run OVERRIDES` in a subprocess, from run_dir's parent; fails the test on error."""
    proc = subprocess.run(
        [sys.executable, "-m", "saferun", "run", *overrides, f"hydra.run.dir={run_dir}",
         "trainer.progress_bar=false"],
        cwd=run_dir.parent, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, (f"saferun run failed ({proc.returncode}):\n"
                                  f"{proc.stdout}\n{proc.stderr}")
    return proc


class LossRecorder(saferun.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, view: Any, metrics: Any) -> None:
        self.losses.append(metrics["train/loss"])


def build_recipe(recipe: str, tmp_path: Path, *overrides: str,
                 callbacks: Sequence[saferun.Callback] = ()) -> saferun.Trainer:
    """The recipe's Trainer, from its config as `saferun run` composes it (CPU, no logger)."""
    config = compose_config([f"recipe={recipe}", "trainer.device=cpu", "logger=none",
                             f"trainer.run_dir={tmp_path}", *overrides])
    task = dict(config.task)
    return get_class(task.pop("_target_"))(config, callbacks=callbacks, **task)


def assert_golden_losses(recipe: str, tmp_path: Path) -> None:
    """The recipe's first 5 losses equal recipes/golden/RECIPE.json, the file `saferun new`
    copies into a project (`pytest --saferun-update-golden` refreshes it): the same job,
    overrides and helper as the project's own test."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(corpus_text())
    overrides = [o.replace("{corpus}", str(corpus)) for o in GOLDEN_OVERRIDES[recipe]]
    job = testing.recipe(recipe, *TEST_OVERRIDES[recipe], *overrides)
    testing.assert_golden_losses(job, golden_file(recipe), tmp_dir=tmp_path / "run")
