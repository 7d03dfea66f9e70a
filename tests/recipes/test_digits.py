"""The digits recipe (the default job): golden first losses and (slow) its stated quality.

Its smoke run through the CLI is tests/cli/test_cli.py (`saferun run debug=fast`).
"""

import json

import pytest
import torch

from recipe_tools import LossRecorder, build_recipe, saferun_run

# train/loss at steps 1-5, recorded on CPU (torch 2.13, fp32, one thread) with seed 0.
GOLDEN_LOSSES = [2.583805, 2.443817, 2.309967, 2.308007, 1.800929]


def test_golden_first_losses(tmp_path):
    assert torch.get_num_threads() == 1  # set by tests/conftest.py; numerics depend on it
    recorder = LossRecorder()
    build_recipe("digits", tmp_path, "trainer.max_steps=5", "trainer.log_every_n_steps=1",
                 callbacks=[recorder]).fit()
    assert recorder.losses == pytest.approx(GOLDEN_LOSSES, rel=1e-4)


@pytest.mark.slow
def test_reaches_stated_quality(tmp_path):
    """The docstring's promise: at least 97% validation accuracy after 1500 steps."""
    saferun_run("recipe=digits", run_dir=tmp_path / "run", timeout=900)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["step"] == 1500 and summary["metrics"]["val/acc"] >= 0.97
