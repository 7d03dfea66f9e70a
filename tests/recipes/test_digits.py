"""The digits recipe (the default job): golden first losses and (slow) its stated quality.

Its smoke run through the CLI is tests/cli/test_cli.py (`saferun run debug=fast`).
"""

import json

import pytest
import torch

from recipe_tools import assert_golden_losses, build_recipe, saferun_run



def test_golden_first_losses(tmp_path):
    assert_golden_losses("digits", tmp_path)


@pytest.mark.slow
def test_reaches_stated_quality(tmp_path):
    """The docstring's promise: at least 97% validation accuracy after 1500 steps."""
    saferun_run("recipe=digits", run_dir=tmp_path / "run", timeout=900)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["step"] == 1500 and summary["metrics"]["val/acc"] >= 0.97
