"""What saferun promises under torchrun (docs/distributed.md), from one real 2-process launch (gloo on the CPU)
of two runs: metrics averaged over ranks, validation shards counting each sample once, no
gradient all-reduce before a step's last micro-batch (saferun's averaging and DDP's no_sync),
find_unused_parameters, per-rank randomness, a training split reshuffled every epoch; then
the same-number-of-processes check on resume."""

import json
import os
import subprocess
import sys

import pytest

import saferun
from saferun.checkpoint import list_checkpoints, load_checkpoint
from rank_job import N_TRAIN, N_VAL, RankJob
from helpers import free_port
from test_torchrun import TIMEOUT

JOB = os.path.join(os.path.dirname(__file__), "rank_job.py")


def config(run_dir, find_unused=True):
    return {"trainer": {"max_steps": 4, "batch_size": 2, "accumulate": 3, "log_every_n_steps": 2,
                        "find_unused_parameters": find_unused, "run_dir": str(run_dir),
                        "progress_bar": False, "device": "cpu"},
            "optim": {"_target_": "torch.optim.SGD", "lr": 0.1}, "logger": {}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ranks")
    configs = [config(root / "unused"), config(root / "ddp", find_unused=False)]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         f"--master_port={free_port()}", JOB, *map(json.dumps, configs)],
        capture_output=True, text=True, timeout=TIMEOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {name: (root / name, [json.loads((root / name / f"record_rank{r}.json").read_text())
                                 for r in (0, 1)]) for name in ("unused", "ddp")}


@pytest.fixture
def launched(runs):
    return runs["unused"]


def test_logged_metrics_are_averaged_over_ranks(launched):
    _, (r0, r1) = launched
    assert r0["logs"] == r1["logs"] and r0["vals"] == r1["vals"]  # every rank sees the same
    assert [m["train/rank"] for m in r0["logs"]] == [0.5, 0.5]  # (0 + 1) / 2 at steps 2 and 4
    # a key one rank logs is its mean there, on every rank: not mixed with the other's column
    assert [(m["train/only_rank0"], m["train/only_rank1"]) for m in r0["logs"]] == [(10, 11)] * 2
    # train/loss: the mean over the ranks of each rank's own losses since the last log point
    for i, m in enumerate(r0["logs"]):  # (log points at steps 2 and 4)
        own = [sum(r["losses"][2 * i:2 * i + 2]) / 2 for r in (r0, r1)]
        assert own[0] != own[1] and m["train/loss"] == pytest.approx(sum(own) / 2, rel=1e-6)


def test_validation_counts_every_sample_once(launched):
    _, (r0, _) = launched
    squares = [i * i for i in range(N_VAL)]
    for metrics in r0["vals"]:  # rank 0 holds ids 0, 2, 4; rank 1 ids 1, 3; no padding
        assert metrics["val/id_squared"] == pytest.approx(sum(squares) / N_VAL)
        assert metrics["val/rank"] == pytest.approx(2 / N_VAL)


@pytest.mark.parametrize("name", ["unused", "ddp"])
def test_no_gradient_all_reduce_before_a_steps_last_micro_batch(runs, name):
    _, records = runs[name]
    for record in records:
        by_step = {}
        for m in record["micro"]:
            by_step.setdefault(m["step"], []).append(m["allreduces"])
        assert sorted(by_step) == [1, 2, 3, 4] and all(len(v) == 3 for v in by_step.values())
        assert all(len(set(counts)) == 1 for counts in by_step.values())  # none mid-step
        firsts = [by_step[s][0] for s in (1, 2, 3, 4)]
        assert all(b > a for a, b in zip(firsts, firsts[1:]))  # and some after each step


def test_ranks_draw_their_own_randomness_and_split_the_data_anew_every_epoch(launched):
    _, (r0, r1) = launched
    assert [m["draw"] for m in r0["micro"]] != [m["draw"] for m in r1["micro"]]
    order = {}
    for rank, record in enumerate((r0, r1)):
        for m in record["micro"]:
            order.setdefault((rank, m["epoch"]), []).extend(m["ids"])
    for epoch in (0, 1):
        assert sorted(order[0, epoch] + order[1, epoch]) == list(range(N_TRAIN))
    assert order[0, 0] != order[0, 1]


def test_resuming_with_another_number_of_processes_is_refused(launched, tmp_path):
    run_dir, _ = launched
    newest = list_checkpoints(run_dir / "checkpoints")[-1]
    assert len(load_checkpoint(newest)["per_rank"]) == 2  # every rank's RNG state
    cfg = config(run_dir)
    cfg["trainer"]["max_steps"] = 6
    cfg["resume"] = str(newest)
    with pytest.raises(saferun.SaferunError,
                       match=r"written by 2 process\(es\) and this run has 1.*same number"):
        RankJob(cfg).fit()
