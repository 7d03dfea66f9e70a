"""trainer.strategy=mesh on GPUs with NCCL (issue 34): the charlm recipe split by tensor parallel
over 2 GPUs equals one GPU at every step, and dp_shard=2 x tp=2 over 4 GPUs equals FSDP2 on 2.
The same jobs as tests/parallel/test_mesh.py (gloo, CPU), with trainer.device=cuda."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import free_port

pytestmark = pytest.mark.cuda
JOB_DIR = Path(__file__).parents[1] / "parallel"  # mesh_job.py
COMMON = ["recipe=charlm", "debug=fast", "trainer.progress_bar=false", "task.sample_chars=0",
          "data.max_chars=100000", "trainer.max_grad_norm=0.5", "trainer.log_every_n_steps=1",
          "trainer.device=cuda", "task._target_=mesh_job.CountingCharLM"]
TOLERANCE = 1e-4  # relative, per step: cuBLAS sums the split matrices in another order


def gpus(n: int) -> None:
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs")


def run(tmp_path: Path, name: str, nproc: int, *overrides: str) -> dict[int, dict[str, float]]:
    run_dir = tmp_path / name
    launch = [sys.executable, "-m", "saferun", "run"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}", "-m", "saferun", "run"]
    proc = subprocess.run([*launch, *COMMON, *overrides, f"hydra.run.dir={run_dir}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [str(JOB_DIR), os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    out: dict[int, dict[str, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        out.setdefault(row["step"], {}).update(
            {k: v for k, v in row.items() if "/" in k and not k.startswith("perf/")})
    return out


def assert_close(got: dict[int, dict[str, float]], want: dict[int, dict[str, float]]) -> None:
    assert sorted(got) == sorted(want)
    for step, values in want.items():
        for key, value in values.items():
            assert got[step][key] == pytest.approx(value, rel=TOLERANCE), (step, key)


def test_tensor_parallel_on_two_gpus_equals_one_gpu(tmp_path):
    gpus(2)
    assert_close(run(tmp_path, "tp", 2, "trainer.strategy=mesh", "trainer.parallel.tp=2"),
                 run(tmp_path, "one", 1))


def test_a_2d_mesh_on_four_gpus_equals_fsdp_on_two(tmp_path):
    gpus(4)
    assert_close(run(tmp_path, "mesh", 4, "trainer.strategy=mesh", "trainer.parallel.tp=2"),
                 run(tmp_path, "fsdp", 2, "trainer.strategy=fsdp"))
