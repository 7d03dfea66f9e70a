"""Real torchrun (2 processes, gloo on the CPU): a mistake in the user's code on one rank or on
both, under DDP and FSDP, in training and in validation. The job ends; the failing rank prints
the explanation (module, inputs, batch) without replaying a forward that takes part in a
collective (explain_job.Centred all-reduces in forward: a replay on one rank would pair with
the other rank's gradient all-reduce); the other rank prints one line pointing at it instead
of an explanation of its own step. FSDP with a DataLoader built by the user: a
DistributedSampler equals one process, a sampler that does not split is refused.

The default slice is one launch (DDP, rank 1, training: it replaces test_torchrun.py's
exception on rank 1, which it covers); the rest is marked slow."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import free_port
from test_torchrun import TIMEOUT

JOB = str(Path(__file__).with_name("explain_job.py"))
sys.path.insert(0, os.path.dirname(JOB))
from explain_job import Job  # noqa: E402


def config(run_dir, strategy, batch_size=16, max_steps=4):
    return {"trainer": {"max_steps": max_steps, "batch_size": batch_size, "shuffle": False,
                        "log_every_n_steps": 4, "val_every_n_steps": 2, "run_dir": str(run_dir),
                        "progress_bar": False, "strategy": strategy, "collective_timeout": 60},
            "logger": {}, "optim": {"_target_": "torch.optim.SGD", "lr": 0.1}}


def torchrun(cfg, plant):
    proc = subprocess.run(
        # --monitor-interval: torchrun stops the other ranks this long after the first ends
        # (default 0.1 s); on a loaded machine that could stop the other rank before it said
        # its line, which these tests read
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--monitor-interval=3",
         f"--master_port={free_port()}", JOB, json.dumps(cfg), json.dumps(plant)],
        capture_output=True, text=True, timeout=TIMEOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc.returncode, proc.stdout + proc.stderr


def explanation(out, hook, step, rank):
    """The failing rank's explanation: the module after the forward's collective, what it got."""
    assert (f"{hook} failed at step {step} on rank {rank}: a shape mismatch in module 'head' "
            f"(Linear), which received input[0]: float32 (16, 15) cpu") in out, out[-6000:]
    assert f"[rank{rank}]:   batch: batch[0]: float32 (16, 8) cpu; batch[1]: int64 (16,) cpu" in out


def other_rank_line(out, rank, step):
    assert f"rank {rank} stopped after step {step}: a collective with the other ranks failed" in out
    assert f"on rank {rank}:" not in out, out[-6000:]  # no explanation of its own step


def test_a_mistake_on_rank_1_under_ddp_is_explained_there_and_named_by_rank_0(tmp_path):
    rc, out = torchrun(config(tmp_path / "run", "ddp"), {"at": 3, "on_rank": 1})
    assert rc != 0
    explanation(out, "training_step", 3, rank=1)
    other_rank_line(out, rank=0, step=2)
    assert "collective mismatch" not in out
    # rank 0's line is its error, not a log line apart from the raw traceback that ends it
    assert "[rank0]: saferun.errors.ExplainedRuntimeError: rank 0 stopped after step 2: " \
           "a collective with the other ranks failed" in out, out[-6000:]


@pytest.mark.slow
def test_a_users_own_error_that_reads_like_a_peer_failure_is_the_users(tmp_path):
    """Rank 1's training_step raises its own RuntimeError whose message matches a collective
    failure's words: rank 1 explains its step (it must not say nothing is wrong on it); only
    rank 0, whose collective did fail, points at the other rank."""
    plant = {"at": 3, "on_rank": 1, "raises": "Timed out waiting for the feature cache lock"}
    rc, out = torchrun(config(tmp_path / "run", "ddp"), plant)
    assert rc != 0
    assert "training_step failed at step 3 on rank 1" in out, out[-6000:]
    assert "raise RuntimeError(self.raises)" in out  # the user's line
    assert "rank 1 stopped after step" not in out, out[-6000:]
    other_rank_line(out, rank=0, step=2)


@pytest.mark.slow
@pytest.mark.parametrize("where, hook, step", [("train", "training_step", 3),
                                               ("val", "validation_step", 2)])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_mistake_on_rank_1_in_training_or_validation(tmp_path, strategy, where, hook, step):
    if (strategy, where) == ("ddp", "train"):
        pytest.skip("the default test")
    rc, out = torchrun(config(tmp_path / "run", strategy), {"at": step, "on_rank": 1,
                                                            "where": where})
    assert rc != 0
    explanation(out, hook, step, rank=1)
    other_rank_line(out, rank=0, step=step - 1 if where == "train" else step)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_mistake_on_both_ranks_is_explained_by_both(tmp_path, strategy):
    rc, out = torchrun(config(tmp_path / "run", strategy), {"at": 3})
    assert rc != 0
    for rank in (0, 1):
        explanation(out, "training_step", 3, rank)
    assert "a collective with the other ranks failed" not in out


@pytest.mark.slow
def test_fsdp_with_a_users_distributed_sampler_equals_one_process(tmp_path):
    run_dir = tmp_path / "run"
    rc, out = torchrun(config(run_dir, "fsdp", max_steps=8), {"loader": "distributed"})
    assert rc == 0, out[-6000:]
    # one process, batches of 32 in order: rank r's batch j holds samples 32j + r, 32j + r + 2..
    one = Job(config(tmp_path / "one", "auto", batch_size=32, max_steps=8))
    one.fit()
    expected = one.model.state_dict()
    for rank in (0, 1):
        got = torch.load(run_dir / f"final_rank{rank}.pt", weights_only=True)
        assert got.keys() == expected.keys()
        for k in expected:
            torch.testing.assert_close(got[k], expected[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.slow
def test_fsdp_refuses_a_users_loader_that_does_not_split_the_data(tmp_path):
    run_dir = tmp_path / "run"
    rc, out = torchrun(config(run_dir, "fsdp"), {"loader": "random"})
    assert rc != 0
    for rank in (0, 1):
        error = (run_dir / f"error_rank{rank}.txt").read_text()
        assert "RandomSampler, which does not split them between the processes" in error
        assert "DistributedSampler" in error
    assert not (run_dir / "checkpoints").exists()
