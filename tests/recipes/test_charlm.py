"""The charlm recipe: a smoke run of the real CLI, golden first losses, (slow) its quality."""

import json
import math
from pathlib import Path

import pytest
import torch

import saferun
from recipe_tools import assert_golden_losses, build_recipe, saferun_run

# A fixed corpus for the golden test: the default one is this Python's standard
# library, whose text changes between CPython releases.
CORPUS = "".join(f"def f{i}(x, y={i % 7}):\n    return x * {i} + y  # {i:04x}\n\n"
                 for i in range(3000))



def test_smoke_run_through_the_cli(tmp_path):
    proc = saferun_run("recipe=charlm", "debug=fast", run_dir=tmp_path / "run", timeout=120)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["name"] == "charlm" and summary["step"] == 10
    metrics = summary["metrics"]
    assert math.isfinite(metrics["val/bpc"])
    assert metrics["val/bpc"] == pytest.approx(metrics["val/loss"] / math.log(2))
    assert "charlm sample:\ndef " in proc.stdout


def build(tmp_path: Path, *overrides: str, callbacks=()) -> saferun.Trainer:
    return build_recipe("charlm", tmp_path, *overrides, callbacks=callbacks)


def test_golden_first_losses(tmp_path):
    assert_golden_losses("charlm", tmp_path)


def test_sample_runs_in_eval_and_inference_mode_restores_modes_and_is_seeded(tmp_path):
    trainer = build(tmp_path)
    trainer.setup()
    model = trainer.model
    model.blocks[0].eval()  # a mixed state, which model.train() afterwards would not restore
    before = [m.training for m in model.modules()]
    seen = []
    model.register_forward_hook(
        lambda m, args, out: seen.append((m.training, torch.is_inference_mode_enabled())))
    first, second = trainer.sample(30), trainer.sample(30)
    assert first == second and len(first) == 30
    assert set(seen) == {(False, True)}
    assert [m.training for m in model.modules()] == before


@pytest.mark.slow
def test_reaches_stated_quality(tmp_path):
    """The docstring's promise: val bpc below 2.15 after the recipe's 1500 steps."""
    proc = saferun_run("recipe=charlm", run_dir=tmp_path / "run", timeout=900)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["step"] == 1500
    assert summary["metrics"]["val/bpc"] < 2.15
    assert "charlm sample:" in proc.stdout
