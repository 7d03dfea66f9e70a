"""Trainer.test() under real torchrun (2 ranks, gloo): the same numbers as one process."""

import json
import os
import subprocess
import sys

import pytest

from test_torchrun import TIMEOUT, free_port
from toys import toy_config

JOB = os.path.join(os.path.dirname(__file__), "eval_job.py")


@pytest.mark.slow
def test_test_under_torchrun_equals_one_process(tmp_path):
    cfg = toy_config(tmp_path, max_steps=2, val_batch_size=8)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(JOB)),
                                          os.environ.get("PYTHONPATH", "")])}
    one = tmp_path / "one.json"
    proc = subprocess.run([sys.executable, JOB, json.dumps(cfg), str(one)], capture_output=True,
                          text=True, timeout=TIMEOUT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    two = tmp_path / "two.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           f"--master_port={free_port()}", JOB, json.dumps(cfg), str(two)],
                          capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # every sample once: shards of 31 and 30, not the whole set on each rank
    assert sorted(int((tmp_path / f"two.json.rank{r}").read_text()) for r in (0, 1)) == [30, 31]
    single, ranks = json.loads(one.read_text()), json.loads(two.read_text())
    assert set(single) == {"test/loss", "test/acc", "test/worst"}
    for k, v in single.items():
        assert ranks[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
