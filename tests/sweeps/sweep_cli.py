"""The real `saferun` command in a subprocess, with this folder importable by its jobs."""

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
FAST = ["recipe=tabular", "debug=fast", "trainer.progress_bar=false"]


def saferun_cli(*args, cwd, check=True, timeout=400):
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    env.pop("SAFERUN_RUN_ID", None)
    proc = subprocess.run([sys.executable, "-m", "saferun", "run", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"saferun run {' '.join(args)} failed ({proc.returncode}):\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc

