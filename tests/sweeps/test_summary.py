"""A run's objective and a sweep's summary, from files as runs write them (fast, default run)."""

import json
import math

import pytest

from saferun.errors import ConfigError
from saferun.sweep.objective import Objective, best_during_run, objective_of
from saferun.sweep.summary import sweep_summary


def test_the_objective_is_sweep_metric_else_save_best_else_val_loss():
    assert objective_of(None, None, None, None) == Objective("val/loss", "min")
    assert objective_of(None, None, "val/acc", "max") == Objective("val/acc", "max")
    assert objective_of(None, None, "val/score", "max") == Objective("val/score", "max")
    assert objective_of("val/f1", "max", "val/acc", "min") == Objective("val/f1", "max")
    assert objective_of("val/acc", None, "val/acc", "max") == Objective("val/acc", "max")
    assert objective_of("val/acc", None, "val/acc", None) == Objective("val/acc", "max")  # the name
    assert objective_of("val/f1", None, "val/acc", "min") == Objective("val/f1", "max")  # the name
    with pytest.raises(ConfigError, match="sweep.metric=val/score: .* Say it: sweep.mode=max"):
        objective_of("val/score", None, "val/acc", "max")  # a guessed direction could rank backwards


def write_run(run_dir, vals, overrides, train_loss=1.0, partial=False):
    """A run directory as a run leaves it: metrics.jsonl (train and val lines) and summary.json."""
    run_dir.mkdir(parents=True)
    lines = []
    for step, acc in vals:
        lines.append({"kind": "train", "step": step, "train/loss": train_loss, "val/acc": -1.0})
        lines.append({"kind": "val", "step": step, "val/acc": acc, "val/loss": 1 - acc})
    text = "".join(json.dumps(x) + "\n" for x in lines)
    (run_dir / "metrics.jsonl").write_text(text + ('{"kind": "val", "step": 99, "val/a' if partial else ""))
    final = {"val/acc": vals[-1][1], "val/loss": 1 - vals[-1][1], "train/loss": train_loss}
    objective = Objective("val/acc", "max").result(str(run_dir), final, vals[-1][0])
    (run_dir / "summary.json").write_text(json.dumps({
        "run_dir": str(run_dir), "overrides": overrides, "step": vals[-1][0], "metrics": final,
        "objective": objective}))
    return objective


def test_best_during_run_reads_the_validations_not_the_train_lines_and_skips_nan(tmp_path):
    # the train lines carry val/acc=-1 (never the best of max): only "val" lines count;
    # a NaN is never the best; the same best later does not move the step; a line cut by a
    # crash ends the file
    o = write_run(tmp_path / "r", [(5, math.nan), (10, 0.7), (15, 0.9), (20, 0.9), (25, 0.6)],
                  ["x=1"], partial=True)
    assert o == {"metric": "val/acc", "mode": "max", "value": 0.9, "step": 15, "final": 0.6}
    assert best_during_run(str(tmp_path / "r"), Objective("val/loss", "min")) == \
        (pytest.approx(0.1), 15)
    assert best_during_run(str(tmp_path / "none"), Objective("val/loss", "min")) is None
    # without metrics.jsonl (logger=none), the final value at the final step is all there is
    assert Objective("val/acc", "max").result(str(tmp_path / "none"), {"val/acc": 0.5}, 30) == \
        {"metric": "val/acc", "mode": "max", "value": 0.5, "step": 30, "final": 0.5}


def test_the_summary_ranks_jobs_by_their_best_marks_the_best_and_lists_failed_jobs(tmp_path):
    common = ["recipe=tabular", "debug=fast"]
    # job 0 peaks mid-run higher than job 1 ends, though it ends lower: the best ranks first
    write_run(tmp_path / "0", [(10, 0.6), (20, 0.95), (30, 0.5)], [*common, "optim.lr=0.1"])
    write_run(tmp_path / "1", [(10, 0.8), (20, 0.85), (30, 0.8)], [*common, "optim.lr=0.01"])
    write_run(tmp_path / "2", [(10, 0.1), (20, 0.2), (30, 0.3)], [*common, "optim.lr=0.001"])
    (tmp_path / "3").mkdir()  # a job that failed: no summary.json
    lines = sweep_summary(tmp_path).splitlines()
    assert lines[0].startswith("3 jobs ranked by val/acc (max)")
    assert lines[1] == f"best: job 0 (recipe=tabular debug=fast optim.lr=0.1), val/acc 0.95 at " \
                       f"step 20, run directory {tmp_path / '0'}"
    assert lines[2] == "every job: recipe=tabular debug=fast"
    assert lines[3].split() == ["job", "val/acc", "best", "at", "step", "val/acc", "final",
                                "train/loss", "val/loss", "overrides"]
    rows = [line.split() for line in lines[4:]]
    assert rows[0] == ["*", "0", "0.95", "20", "0.5", "1", "0.5", "optim.lr=0.1"]
    assert rows[1] == ["1", "0.85", "20", "0.8", "1", "0.2", "optim.lr=0.01"]
    assert rows[2] == ["2", "0.3", "30", "0.3", "1", "0.7", "optim.lr=0.001"]
    assert rows[3] == ["3", "no", "summary.json:", "failed", "or", "interrupted"]


def test_a_job_without_the_metric_ranks_last_and_different_objectives_keep_job_order(tmp_path):
    write_run(tmp_path / "0", [(10, 0.5)], ["a=1"])
    write_run(tmp_path / "1", [(10, 0.9)], ["a=2"])
    write_run(tmp_path / "2", [(10, 0.7)], ["a=3"])
    summary = json.loads((tmp_path / "1" / "summary.json").read_text())
    summary["objective"] = None  # its validation never reported the metric
    (tmp_path / "1" / "summary.json").write_text(json.dumps(summary))
    lines = sweep_summary(tmp_path).splitlines()
    assert [line.split()[:3] for line in lines[3:]] == [["*", "2", "0.7"], ["0", "0.5", "10"],
                                                        ["1", "-", "-"]]
    summary["objective"] = {"metric": "val/loss", "mode": "min", "value": 0.1, "step": 10,
                            "final": 0.1}  # ranked by another metric (a different sweep.metric)
    (tmp_path / "1" / "summary.json").write_text(json.dumps(summary))
    lines = sweep_summary(tmp_path).splitlines()
    assert lines[0].startswith("3 jobs in job order (the jobs rank by different metrics")
    assert [line.split()[0] for line in lines[2:]] == ["0", "1", "2"]
    assert "*" not in "".join(lines)
