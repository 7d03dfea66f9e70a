"""The benchmark command runs and writes its report. Never a timing assertion: timings on a
shared machine are noise; benchmarks/run.py and docs/benchmarks.md are where speed is measured.
"""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
