"""The digits recipe (the default job): golden first losses and (slow) its stated quality.

Its smoke run through the CLI is tests/cli/test_cli.py (`saferun run debug=fast`).
"""

import json

import pytest

from recipe_tools import assert_golden_losses, build_recipe, saferun_run



def test_golden_first_losses(tmp_path):
    assert_golden_losses("digits", tmp_path)


@pytest.mark.slow
def test_reaches_stated_quality(tmp_path):
    """The docstring's promise: at least 97% validation accuracy after 1500 steps."""
    saferun_run("recipe=digits", run_dir=tmp_path / "run", timeout=900)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["step"] == 1500 and summary["metrics"]["val/acc"] >= 0.97


def test_macro_f1_matches_scikit_learn_and_can_be_watched(tmp_path):
    """val/f1 (a torchmetrics metric, computed over the whole validation set, not averaged
    over batches) equals sklearn's macro-F1 on the same predictions; save_best can watch it."""
    from sklearn.metrics import f1_score

    trainer = build_recipe("digits", tmp_path, "trainer.max_steps=6", "trainer.val_batch_size=16",
                           "trainer.val_every_n_steps=3", "trainer.save_best=val/f1",
                           "trainer.save_best_mode=max")
    metrics = trainer.fit()
    val = trainer.val_loader.dataset
    predicted = trainer.predict(val).argmax(dim=1)
    expected = f1_score(val.labels.numpy(), predicted.numpy(), average="macro")
    assert metrics["val/f1"] == pytest.approx(expected, rel=1e-5)
    # what a batch-weighted mean of per-batch F1 would report instead: far off
    per_batch = [f1_score(val.labels[i:i + 16], predicted[i:i + 16], average="macro") *
                 len(val.labels[i:i + 16]) for i in range(0, len(val), 16)]
    assert abs(sum(per_batch) / len(val) - expected) > 0.02
    assert trainer._checkpointer.best.value == max(metrics["val/f1"], trainer._checkpointer.best.value)
