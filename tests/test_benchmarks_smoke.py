"""The benchmark command runs and writes its report. Never a timing assertion: timings on a
shared machine are noise; benchmarks/run.py and docs/benchmarks.md are where speed is measured.
"""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # 10 s of subprocesses; test_step_micro_benchmark_runs_and_reports is the fast slice
def test_benchmark_smoke_run_writes_its_report(tmp_path):
    # hand and saferun only: a Lightning process spends ~10 s importing lightning alone.
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "run.py"), "--smoke", "--device", "cpu",
           "--variants", "hand,saferun", "--report-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    report = (tmp_path / "results.md").read_text()
    assert "| hand |" in report and "| saferun |" in report
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert [r["variant"] for r in runs] == ["hand", "saferun"]
    for r in runs:
        assert r["step_mean_ms"] > 0 and r["peak_rss_mib"] > 0
        assert r["host"]["plain_step_syncs"] == 0, r["host_sites"]
    # Same seed, data order and schedule: both did the same work.
    assert runs[0]["metrics"] == runs[1]["metrics"]


@pytest.mark.slow  # 25 s of subprocesses
def test_the_charlm_workload_does_the_same_work_in_both_loops(tmp_path):
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "run.py"), "--smoke", "--device", "cpu",
           "--variants", "hand,saferun", "--workloads", "charlm", "--report-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert [(r["variant"], r["job"]["workload"], r["job"]["batch_size"]) for r in runs] == [
        ("hand", "charlm", 32), ("saferun", "charlm", 32)]
    # the recipe's Transformer, the same steps; saferun divides the batch-weighted sums in
    # float64 and the hand loop in float32, which shows in the 7th digit here
    hand, saferun = runs[0]["metrics"], runs[1]["metrics"]
    assert saferun == pytest.approx(hand, rel=1e-6)
    assert all(r["host"]["plain_step_syncs"] == 0 for r in runs)


@pytest.mark.slow  # two torchrun jobs of 4 processes
def test_the_mesh_benchmark_runs_both_arms_on_the_same_work(tmp_path):
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "mesh.py"), "--rounds", "1",
           "--steps", "4", "--warmup", "2", "--log-every", "2", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| 1 |" in proc.stdout and "median ratio over 1 round(s)" in proc.stdout
    # the launcher exits unless the arms logged the same losses; they are written per arm
    arms = {arm: json.loads((tmp_path / "round0" / f"{arm}.json").read_text())
            for arm in ("hand", "saferun")}
    assert arms["hand"]["losses"].keys() == arms["saferun"]["losses"].keys() == {"2", "4"}
    assert arms["saferun"]["losses"] == pytest.approx(arms["hand"]["losses"], rel=1e-4)


def test_step_micro_benchmark_runs_and_reports(tmp_path, monkeypatch, capsys):
    # A few pairs, in this process (a subprocess would spend seconds importing torch again):
    # the in-process comparison runs, both steps did the same arithmetic (the script exits
    # otherwise) and every figure is reported.
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    import step_micro

    out = tmp_path / "micro.json"
    monkeypatch.setattr(sys, "argv", ["step_micro.py", "--pairs", "6", "--warmup", "2",
                                      "--count-steps", "2", "--batches", "4", "--json", str(out)])
    step_micro.main()
    printed = capsys.readouterr().out
    for text in ("per-pair ratio", "median paired difference", "ratio of medians",
                 "python_calls", "torch_ops", "host_syncs", "bitwise equal"):
        assert text in printed, printed

    r = json.loads(out.read_text())
    assert r["workload"] == "mlp" and not r["control"]
    for clock in ("wall", "cpu"):
        assert r[clock]["pairs"] == 6
        for key in ("pair_ratio", "pair_ratio_ci95", "diff_us", "diff_ci95_us", "diff_iqr_us",
                    "ratio_of_medians", "hand_median_us", "saferun_median_us"):
            assert key in r[clock], key
    # Counts, not timings: the same model, loss and optimizer dispatch the same torch ops,
    # and neither step reads a value from the device; but for two: the hand step's
    # zero_grad() opens a profiler annotation (an enter and an exit op) that saferun's zeroing
    # leaves out when no profiler runs (loop/update.py's release_grads).
    saferun, hand = r["per_step"]["saferun"], r["per_step"]["hand"]
    assert saferun["torch_ops"] == hand["torch_ops"] - 2 > 0
    assert saferun["host_syncs"] == hand["host_syncs"] == 0
    assert saferun["python_calls"] > 0 and hand["python_calls"] > 0
    # The MLP's 6 parameters, plus AdamW's step, exp_avg and exp_avg_sq for each.
    assert r["bitwise_equal_tensors"] == 6 + 3 * 6


def test_step_micro_refuses_steps_that_did_different_arithmetic(tmp_path, monkeypatch):
    # The comparison is only fair if both steps compute the same thing: the state check must
    # see a single extra step on one side.
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    import step_micro

    trainer, hand, model, opt, groups = step_micro.build("mlp", str(tmp_path), 2)
    assert step_micro.check_same_state(trainer, model, opt) == 6  # no optimizer state yet
    trainer.train_step(groups[0])
    hand(groups[0])
    assert step_micro.check_same_state(trainer, model, opt) == 6 + 3 * 6
    trainer.train_step(groups[1])
    with pytest.raises(SystemExit, match="not the same arithmetic"):
        step_micro.check_same_state(trainer, model, opt)


@pytest.mark.slow  # nine fresh processes; tests/loop/test_loop_cost.py runs the counts in-process
def test_loop_window_benchmark_quick_run_reports_times_and_counts(tmp_path):
    out = tmp_path / "window.json"
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "loop_window.py"), "--quick",
           "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(out.read_text())
    assert r["window"] == [51, 150]
    summary = r["timed"]["summary"]
    assert set(summary) == {"hand", "saferun", "strict"}
    assert summary["hand"]["median_ratio"] == 1.0
    for v in ("saferun", "strict"):
        assert summary[v]["median_us_per_step"] > 0 and summary[v]["ratio_range"][0] > 0
    counts = r["per_step"]
    for v, c in counts.items():
        assert c["python_calls"] > c["plain_step_python_calls"] * 0.9 > 0, v
        assert c["torch_ops"] > 0 and c["syncs_between_log_points"] == 0, (v, c)
    # the hand loop reads its loss once per log interval; saferun reads its metrics once too
    assert counts["hand"]["syncs_per_step"] == pytest.approx(1 / 100)
    # the same model and optimizer: saferun adds no torch operator to a plain step
    assert counts["saferun"]["plain_step_torch_ops"] <= counts["hand"]["plain_step_torch_ops"]


@pytest.mark.slow  # three fresh processes at once, on one core
def test_loop_window_lockstep_runs_the_variants_in_turns_that_never_overlap(tmp_path):
    """With a baseline checkout (here a copy of this one): five variants in turns."""
    baseline = tmp_path / "baseline"
    shutil.copytree(os.path.join(REPO, "saferun"), baseline / "saferun")
    out = tmp_path / "lockstep.json"
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "loop_window.py"), "--lockstep", "25",
           "--rounds", "1", "--steps", "150", "--start", "50", "--baseline", str(baseline),
           "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(out.read_text())
    runs = {x["variant"]: x for x in r["timed"]["runs"]}
    assert set(runs) == {"hand", "saferun", "strict", "saferun@baseline", "strict@baseline"}
    assert r["timed"]["block"] == 25
    for v in ("saferun", "strict"):  # each ran its own checkout's saferun
        assert runs[v]["saferun"] != str(baseline) and runs[v + "@baseline"]["saferun"] == str(baseline)
    turns = sorted((t0, t1, v) for v, x in runs.items() for t0, t1 in x["turn_spans_ns"])
    assert len(turns) == 5 * 4  # the window's 100 steps in turns of 25, per variant
    for (_, end, _), (start, _, _) in zip(turns, turns[1:]):
        assert end <= start  # one variant at a time
    order = [v for _, _, v in turns]
    assert order == order[:5] * 4  # in a fixed rotation
    for x in runs.values():
        assert len(x["block_us_per_step"]) == 4 and x["median_step_us"] > 0
        assert x["us_per_step"] == pytest.approx(sum(x["block_us_per_step"]) / 4)
    assert r["timed"]["summary"]["hand"]["median_ratio"] == 1.0


@pytest.mark.slow  # three runs under valgrind (a minute or two each, mostly imports)
@pytest.mark.skipif(shutil.which("valgrind") is None or shutil.which("callgrind_control") is None,
                    reason="needs valgrind's callgrind")
def test_loop_window_counts_instructions_per_step_under_callgrind(tmp_path):
    out = tmp_path / "instructions.json"
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "loop_window.py"), "--instructions",
           "--steps", "104", "--start", "100", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(out.read_text())["instructions"]
    assert set(r) == {"hand", "saferun", "strict"} and r["hand"]["ratio"] == 1.0
    # the window's four steps only: a step of this MLP is millions of instructions, a whole
    # counted run (imports, setup) would be billions
    for v, c in r.items():
        assert 1e6 < c["instructions_per_step"] < 1e8, (v, c)
    assert r["saferun"]["ratio"] > 1.0  # (its window opens before step 100's log point)


def test_a_threads_benchmark_run_uses_its_arms_thread_count(tmp_path, monkeypatch):
    # one arm's run (a fresh `saferun run` of the README's job, two steps): the thread count it
    # forces is the one the run's plan says it used
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    import threads

    got = threads.one_run("digits", "1", 2, 2, str(tmp_path / "run"))
    assert got["plan"].startswith("1 intra-op") and "trainer.num_threads" in got["plan"], got
    assert got["val_loss"] is not None and math.isfinite(got["val_loss"])  # it trained (no timing)


@pytest.mark.slow  # 8 fresh `saferun run` processes, 4 of them beside a busy process
def test_the_threads_benchmark_runs_every_arm_quiet_and_busy_and_reports_the_ratio(tmp_path):
    out = tmp_path / "threads.json"
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "threads.py"), "--workloads", "digits",
           "--rounds", "1", "--steps", "2", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(out.read_text())
    assert sorted((x["condition"], x["arm"]) for x in r["runs"]) == sorted(
        (c, a) for c in ("quiet", "busy") for a in ("auto", "1", "2", "torch"))
    plans = {x["arm"]: x["plan"] for x in r["runs"] if x["condition"] == "quiet"}
    assert "auto:" in plans["auto"] and plans["2"].startswith("2 intra-op")
    assert plans["torch"].startswith(f"{r['torch_default_threads']} intra-op")
    assert set(r["table"]) == {"digits quiet", "digits busy"}
    assert all(row["auto_over_best"] > 0 for row in r["table"].values())
    assert "auto / best forced" in proc.stdout
