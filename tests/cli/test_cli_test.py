"""`saferun test RUN_DIR`: the real command in a subprocess on a real (debug-sized) tabular run."""

import json
import subprocess
import sys

import pytest

RUN = ["run", "recipe=tabular", "debug=fast", "trainer.progress_bar=false"]


def saferun(*args, cwd):
    return subprocess.run([sys.executable, "-m", "saferun", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def printed(stdout):
    return {line.split()[0]: float(line.split()[1]) for line in stdout.splitlines()
            if line.startswith("test/")}


@pytest.mark.slow
def test_saferun_test_evaluates_the_best_model_on_the_test_split(tmp_path):
    proc = saferun(*RUN, "hydra.run.dir=r", "data.test_fraction=0.1", "trainer.save_best=val/r2",
                   "trainer.save_best_mode=max", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    before = sorted(p.name for p in (tmp_path / "r").iterdir())
    proc = saferun("test", "r", "out_dir=eval", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    shown = printed(proc.stdout)
    assert set(shown) == {"test/loss", "test/mse", "test/r2", "test/rmse"}
    # the same numbers as the Python API gives, with the run's model_best.pt
    from saferun.recipes.tabular import TabularTrainer

    expected = TabularTrainer.from_run(str(tmp_path / "r"), "best", out_dir=str(tmp_path / "o")).test()
    assert shown == pytest.approx(expected, rel=1e-5)
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["test"] == pytest.approx(expected)
    # which weights of which run: the file, its step and epoch (those of model_best.pt's
    # record), its sha256; the log line says the same
    import hashlib

    best = json.loads((tmp_path / "r" / "summary.json").read_text())["weights"]["model_best.pt"]
    file = tmp_path / "r" / "model_best.pt"
    assert summary["tested"] == {"run": str((tmp_path / "r").resolve()), "checkpoint": str(file.resolve()),
                                 "step": best["step"], "epoch": best["epoch"],
                                 "sha256": hashlib.sha256(file.read_bytes()).hexdigest()}
    assert (f"{file.resolve()}, step {best['step']}, epoch {best['epoch']}, sha256 "
            f"{summary['tested']['sha256']}") in proc.stdout + proc.stderr
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == before  # the run is not written
    proc = saferun("test", "r", "checkpoint=latest", cwd=tmp_path)
    assert proc.returncode == 1 and "checkpoint='latest' does not exist: name best (model_best.pt), last" in proc.stderr


@pytest.mark.slow
def test_saferun_test_refuses_a_run_without_a_test_split(tmp_path):
    proc = saferun(*RUN, "hydra.run.dir=r", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    proc = saferun("test", "r", "checkpoint=last", cwd=tmp_path)
    assert proc.returncode == 1 and "no test set" in proc.stderr
    proc = saferun("test", "r", cwd=tmp_path)  # no save_best: no model_best.pt
    assert proc.returncode == 1 and "trainer.save_best" in proc.stderr
    proc = saferun("test", cwd=tmp_path)
    assert proc.returncode == 2 and "usage: saferun test" in proc.stderr
