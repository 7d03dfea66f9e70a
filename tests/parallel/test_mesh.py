"""trainer.strategy=mesh (issue 34): the task's parallelize(model, mesh) on a device mesh of
trainer.parallel's shape, here the charlm recipe's tensor-parallel plan, run by the real CLI
under torchrun with gloo on the CPU. Tensor parallel alone (2 processes) runs by default;
the 2-D mesh (4 processes) and the stop-and-resume cases are marked slow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from saferun import ConfigError
from saferun.parallel import distributed
from saferun.parallel.mesh import Layout, apply_plan

from helpers import free_port

HERE = Path(__file__).parent
TIMEOUT = 600
# the smoke job of the recipe with a small corpus, a clipping that acts at every step (the
# gradient norm is above 1.5 at the start) and one log point per step
COMMON = ["recipe=charlm", "debug=fast", "trainer.progress_bar=false", "task.sample_chars=0",
          "data.max_chars=100000", "trainer.max_grad_norm=0.5", "trainer.log_every_n_steps=1",
          "task._target_=mesh_job.CountingCharLM"]
TOLERANCE = 1e-5  # relative, per step: the tensor-parallel sums are taken in another order


def run_job(tmp_path: Path, name: str, *overrides: str, nproc: int = 1,
            check: bool = True) -> tuple[subprocess.CompletedProcess[str], Path]:
    run_dir = tmp_path / name
    launch = [sys.executable, "-m", "saferun", "run"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}", "-m", "saferun", "run"]
    proc = subprocess.run([*launch, *COMMON, *overrides, f"hydra.run.dir={run_dir}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT,
                          env={**os.environ, "OMP_NUM_THREADS": "1",
                               "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])})
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc, run_dir


def curve(run_dir: Path) -> dict[int, dict[str, float]]:
    """metrics.jsonl by step: every logged value but the timings."""
    out: dict[int, dict[str, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        out.setdefault(row["step"], {}).update(
            {k: v for k, v in row.items() if "/" in k and not k.startswith("perf/")})
    return out


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return run_job(tmp_path_factory.mktemp("one"), "run")[1]


@pytest.fixture(scope="module")
def tensor_parallel(tmp_path_factory):
    return run_job(tmp_path_factory.mktemp("tp"), "run", "trainer.strategy=mesh",
                   "trainer.parallel.tp=2", nproc=2)[1]


def test_tensor_parallel_equals_one_process_at_every_step(one_process, tensor_parallel):
    """Each rank holds half of every split layer, and the losses, the clipped gradient norm
    (over the whole model: DTensor and replicated parameters), validation and the summed
    counts (over the data dimension only) equal one process's at every step."""
    for rank in (0, 1):
        held = json.loads((tensor_parallel / f"rank{rank}.json").read_text())
        assert held == {"dtensor": True, "local_shape": [3 * 96 // 2, 96]}
    want, got = curve(one_process), curve(tensor_parallel)
    assert sorted(got) == sorted(want) == list(range(1, 11))
    for step, values in want.items():
        assert set(got[step]) == set(values), step
        for key, value in values.items():
            assert got[step][key] == pytest.approx(value, rel=TOLERANCE), (step, key)
    assert got[10]["train/seen"] == 32  # one step's batch, counted once (not once per rank)


def test_a_mesh_that_does_not_fit_the_job_is_refused_naming_the_key():
    t = _trainer_config(tp=3)
    with pytest.raises(ConfigError, match=r"trainer.parallel: dp_shard=None x tp=3 must be the number of processes, 4"):
        Layout.of(t, distributed.Ranks(0, 4, 0), torch.device("cpu"))
    with pytest.raises(ConfigError, match="trainer.strategy=mesh .* not launched by torchrun"):
        Layout.of(_trainer_config(tp=2), distributed.Ranks(), torch.device("cpu"))
    with pytest.raises(ConfigError, match="trainer.ema with trainer.strategy=mesh"):
        Layout.of(_trainer_config(tp=2, ema={"decay": 0.9}), distributed.Ranks(0, 2, 0),
                  torch.device("cpu"))
    assert Layout.of(_trainer_config(tp=2), distributed.Ranks(0, 4, 0), torch.device("cpu")) \
        == Layout(dp_shard=2, tp=2)
    with pytest.raises(ConfigError, match="trainer.parallel.tp must be a positive integer"):
        _trainer_config(tp=0)


class Holder:
    """A task whose parallelize returns `out` (None: the model it was given)."""

    def __init__(self, out=None) -> None:
        self.out = out

    def parallelize(self, model, mesh):
        return model if self.out is None else self.out


def test_a_plan_that_replaces_the_model_or_splits_nothing_is_refused():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=r"Holder.parallelize\(model, mesh\) returned Sequential, not "
                                          r"the model it was given: apply the plan in place"):
        apply_plan(Holder(torch.nn.Sequential(model)), model, None, Layout(2, 1))
    with pytest.raises(ConfigError, match=r"trainer.parallel.tp=2, but Holder.parallelize\(model, mesh\) "
                                          r"split no parameter"):
        apply_plan(Holder(), model, None, Layout(1, 2))
    apply_plan(Holder(), model, None, Layout(2, 1))  # no tensor parallel: nothing to split


def _trainer_config(tp: int, **trainer):
    from saferun.config import load_config

    return load_config({"trainer": {"strategy": "mesh", "parallel": {"tp": tp}, **trainer}}).trainer


@pytest.mark.slow
def test_a_stop_on_one_rank_stops_both_and_the_resume_equals_the_uninterrupted_run_bitwise(
        tensor_parallel, tmp_path):
    """SIGTERM on rank 1 only (the metrics are reduced over the data dimension, a group of
    one here: the vote reaches rank 0 on a collective of its own); both save step 4 and exit;
    the resume continues mid-epoch and ends equal to the uninterrupted run, bit for bit."""
    mesh = ["trainer.strategy=mesh", "trainer.parallel.tp=2", "+task.signal_at=4",
            "+task.on_rank=1"]  # (the same config on resume: step 4 is not run again)
    proc, run_dir = run_job(tmp_path, "run", *mesh, nproc=2, check=False)
    assert proc.returncode != 0 and "step-00000004" in str(sorted((run_dir / "checkpoints").iterdir()))
    run_job(tmp_path, "run", *mesh, "resume=auto", nproc=2)
    assert curve(run_dir)[10] == curve(tensor_parallel)[10]
    resumed, whole = (torch.load(d / "model.pt", weights_only=True) for d in (run_dir, tensor_parallel))
    assert resumed.keys() == whole.keys() and all(torch.equal(resumed[k], whole[k]) for k in whole)
