"""A wheel install (not editable) carries its configs and recipes: `saferun run` works anywhere."""

import subprocess
import sys


def test_wheel_install_runs_the_default_job_from_another_directory(tmp_path):
    repo = __file__.rsplit("/tests/", 1)[0]
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), repo],
                   check=True, capture_output=True)
    wheel = next((tmp_path / "dist").glob("saferun-*.whl"))
    site = tmp_path / "site"
    subprocess.run(pip + ["install", "--no-deps", "--target", str(site), str(wheel)], check=True,
                   capture_output=True)
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    where = subprocess.run([sys.executable, "-c", "import saferun.conf, saferun.recipes.digits as d;"
                            "print(saferun.conf.__file__); print(d.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    assert all(line.startswith(str(site)) for line in where.stdout.split())
    run = subprocess.run([sys.executable, "-m", "saferun", "run", "debug=fast",
                          "trainer.progress_bar=false", "logger=none"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert list(tmp_path.glob("runs/digits/*/summary.json"))
