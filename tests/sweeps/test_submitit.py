"""Hydra's submitit launcher with submitit's local executor (real submitit, real subprocesses):
a sweep's jobs, a job of two processes that trains as torchrun does, and a job preempted by a
real signal that is requeued and ends bitwise equal to the uninterrupted one."""

import json
import os
import subprocess
import sys

import pytest
import torch

from saferun.checkpoint import list_checkpoints, load_checkpoint
from sweep_cli import FAST, saferun_cli
from helpers import free_port

pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
pytestmark = pytest.mark.slow  # each test trains several short jobs in subprocesses
LOCAL = ["hydra/launcher=submitit_local", "hydra.launcher.timeout_min=20"]


def final_state(run_dir):
    """The last checkpoint's whole state, less what is wall-clock (the loggers' states, which hold
    throughput and file lengths, and perf/ metrics) or differs by design in the config."""
    state = load_checkpoint(list_checkpoints(run_dir / "checkpoints")[-1])
    state.pop("callbacks")
    config = state["config"]
    for key in ("callbacks", "resume"):  # a launcher's job resumes with resume=auto
        config.pop(key)
    for key in ("run_dir", "stop_signals"):  # where it runs; a launcher's job adds SIGUSR2
        config["trainer"].pop(key)
    state["loop"]["metrics"] = {k: v for k, v in state["loop"]["metrics"].items()
                                if not k.startswith("perf/")}
    return state


def curves(run_dir):
    """metrics.jsonl without its wall-clock fields: every logged value, each step once."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in x.items() if k != "time" and not k.startswith("perf/")} for x in lines]


def assert_same(a, b, path="state"):
    assert type(a) is type(b), path
    if isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), path
    else:
        assert a == b, path


def assert_same_run(a, b):
    assert_same(final_state(a), final_state(b))
    assert_same(torch.load(a / "model.pt"), torch.load(b / "model.pt"))
    assert curves(a) == curves(b)


def test_a_two_job_sweep_runs_each_job_in_its_directory_as_a_plain_run(tmp_path):
    proc = saferun_cli("-m", *FAST, *LOCAL, "optim.lr=1e-3,3e-3", "hydra.sweep.dir=sweep",
                       cwd=tmp_path)
    sweep = tmp_path / "sweep"
    for job, lr in (("0", "0.001"), ("1", "0.003")):
        summary = json.loads((sweep / job / "summary.json").read_text())
        assert summary["run_dir"] == str(sweep / job) and f"optim.lr={lr}" in summary["overrides"]
        assert summary["step"] == 10
    # two submitit jobs (here named by their process ids)
    assert len([p for p in (sweep / ".submitit").iterdir() if p.name.isdigit()]) == 2
    assert "sweep summary" in proc.stdout and (sweep / "summary.txt").is_file()
    saferun_cli(*FAST, "optim.lr=1e-3", "hydra.run.dir=single", cwd=tmp_path)
    assert_same_run(sweep / "0", tmp_path / "single")


def test_a_job_of_two_processes_trains_as_torchrun_does_and_is_requeued_as_one(tmp_path):
    # both ranks receive the preemption signal after step 3; they agree on a step to stop at
    # the next log point (step 4: debug=fast logs every 2 steps), save it, the job is requeued
    # and both resume
    signal_at = ["+callbacks.preempt._target_=sweep_toys.SignalAt", "+callbacks.preempt.steps=[3]"]
    saferun_cli("-m", *FAST, *LOCAL, *signal_at, "hydra.launcher.tasks_per_node=2",
                "hydra.sweep.dir=sweep", cwd=tmp_path)
    (folder,) = [p for p in (tmp_path / "sweep" / ".submitit").iterdir() if p.name.isdigit()]
    log = "".join(p.read_text() for p in sorted(folder.glob("*_0_log.*")))
    assert "saferun: stopped by SIGUSR2 at step 4;" in log and "Requeued job" in log, log
    torchrun = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         f"--master_port={free_port()}", "-m", "saferun", "run", *FAST, "hydra.run.dir=torchrun"],
        cwd=tmp_path, capture_output=True, text=True, timeout=400,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert torchrun.returncode == 0, torchrun.stdout + torchrun.stderr
    state = final_state(tmp_path / "sweep" / "0")
    assert len(state["per_rank"]) == 2  # two ranks, each with its own RNG and data position
    assert_same_run(tmp_path / "sweep" / "0", tmp_path / "torchrun")


def test_preempted_jobs_are_requeued_and_end_as_the_uninterrupted_one(tmp_path):
    # one sweep, three jobs: never signalled, signalled once (mid-epoch, before any validation),
    # signalled twice (the second in the second epoch); SIGUSR2 is submitit's preemption signal
    saferun_cli("-m", *FAST, *LOCAL, "trainer.max_steps=20",
                "+callbacks.preempt._target_=sweep_toys.SignalAt",
                "+callbacks.preempt.steps=[],[3],[3,14]", "hydra.sweep.dir=sweep", cwd=tmp_path)
    sweep = tmp_path / "sweep"
    assert sorted(p.name for p in sweep.iterdir() if p.name.isdigit()) == ["0", "1", "2"]
    # submitit's folder of each job (named by its id, here a pid): rank 0's output and errors
    logs = {folder: "".join(p.read_text() for p in sorted(folder.glob("*_0_log.*")))
            for folder in (sweep / ".submitit").iterdir()}
    for job, stops in (("0", []), ("1", [3]), ("2", [3, 14])):
        log = next(text for text in logs.values() if f"run directory {sweep / job}\n" in text)
        assert [int(line.split(" at step ")[1].split(";")[0]) for line in log.splitlines()
                if line.startswith("saferun: stopped by SIGUSR2 at step")] == stops, log
        assert sum(line.startswith("submitit INFO") and "Requeued job" in line
                   for line in log.splitlines()) == len(stops), log
        assert json.loads((sweep / job / "summary.json").read_text())["step"] == 20
    assert_same_run(sweep / "1", sweep / "0")
    assert_same_run(sweep / "2", sweep / "0")
