"""The run directory: one writer at a time, checked before any work; forced resumes."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import saferun
from saferun.callbacks import Callback
from saferun.checkpoint import rundir
from saferun.checkpoint import list_checkpoints
from toys import TOYS_PATH, SelfSignalling, ToyTrainer, toy_config

# toys.main, with a trainer that waits in step 2 until the file $GATE exists (after
# creating $GATE.waiting), so that a test can act while it holds the run directory.
GATED = f"""
import os, sys, time
import torch
torch.set_num_threads(1)
sys.path.insert(0, {os.path.dirname(TOYS_PATH)!r})
import toys

class Gated(toys.SelfSignalling):
    def training_step(self, batch):
        gate = os.environ.get("GATE")
        if gate and self.state.step == 1:
            open(gate + ".waiting", "w").close()
            deadline = time.time() + 300
            while not os.path.exists(gate) and time.time() < deadline:
                time.sleep(0.01)
        return super().training_step(batch)

toys.SelfSignalling = Gated
toys.main()
"""


def wait_for(path, proc):
    """Until `proc` writes `path`; fails with its output if it ends first (it always ends:
    its own wait for the gate is bounded)."""
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)


def test_a_second_writer_is_refused_and_a_killed_writers_lock_goes_with_it(tmp_path, caplog):
    run_dir = tmp_path / "run"
    cfg = toy_config(tmp_path, max_steps=6, batch_size=16, save_every_n_steps=1)
    gate = tmp_path / "gate"
    first = subprocess.Popen([sys.executable, "-c", GATED, json.dumps(cfg)], text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env={**os.environ, "GATE": str(gate)})
    try:
        wait_for(tmp_path / "gate.waiting", first)  # in step 2; step 1 is saved
        with pytest.raises(saferun.SaferunError) as e:  # this process: another run, same directory
            SelfSignalling(dict(cfg, seed=1)).fit()
        assert f"run directory {run_dir} is in use by another run (pid {first.pid} on" in str(e.value)
        assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step-00000001"]
        assert "seed: 0" in (run_dir / "config.yaml").read_text()
        first.send_signal(signal.SIGKILL)  # no cleanup runs
        first.wait(timeout=60)
    finally:
        first.kill()
        first.communicate()
    resumed = SelfSignalling(dict(cfg, resume="auto"))
    with caplog.at_level("INFO", logger="saferun"):
        resumed.fit()
    assert any("Resumed from" in r.getMessage() and "step 1, epoch 0" in r.getMessage()
               for r in caplog.records)
    assert list_checkpoints(run_dir / "checkpoints")[-1].name == "step-00000006"


# Claims a run directory, forks a child that outlives it (as DataLoader workers do for a
# few seconds when their process is killed), and waits to be killed.
HOLD_AND_FORK = """
import os, sys, time
from saferun.checkpoint import rundir
lock = rundir.claim(sys.argv[1])
if os.fork() == 0:
    deadline = time.time() + 300
    while not os.path.exists(sys.argv[2]) and time.time() < deadline:
        time.sleep(0.05)
    os._exit(0)
print("holding", flush=True)
time.sleep(300)
"""


def test_a_lock_is_gone_with_its_process_even_while_forked_children_live(tmp_path):
    run_dir, done = tmp_path / "run", tmp_path / "done"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_AND_FORK, str(run_dir), str(done)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        with pytest.raises(saferun.SaferunError, match=f"pid {holder.pid} on"):
            rundir.claim(str(run_dir))
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
        rundir.claim(str(run_dir)).release()  # the child still runs, and holds no lock
        with pytest.raises(saferun.SaferunError, match="this process, another Trainer"):
            held = rundir.claim(str(run_dir))
            try:
                rundir.claim(str(run_dir))
            finally:
                held.release()
    finally:
        done.touch()
        holder.kill()
        holder.communicate()


class CountingSteps(ToyTrainer):
    steps_run = 0

    def training_step(self, batch):
        type(self).steps_run += 1
        return super().training_step(batch)


@pytest.mark.parametrize("logger", [{}, {"tensorboard": {"_target_": "saferun.loggers.TensorBoardLogger"}}],
                         ids=["no logger", "tensorboard"])
def test_a_run_dir_that_is_a_file_is_refused_before_any_work(tmp_path, logger):
    (tmp_path / "run").write_text("a file")
    cfg = toy_config(tmp_path, max_steps=3)
    cfg["logger"] = logger
    CountingSteps.steps_run = 0
    with pytest.raises(saferun.SaferunError, match="run directory .*/run exists and is not a directory"):
        CountingSteps(cfg).fit()
    assert CountingSteps.steps_run == 0 and (tmp_path / "run").read_text() == "a file"


def read_only(path):
    """A command prefix under which `path` is read-only (a private read-only bind mount for
    root, whom permissions do not stop), or skip."""
    if os.geteuid() != 0:
        path.chmod(0o555)
        return []
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True) \
        if shutil.which("unshare") else None
    if probe is None or probe.returncode != 0:
        pytest.skip("running as root without mount namespaces: cannot make a read-only directory")
    script = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
    return ["unshare", "--mount", "sh", "-c", script, str(path)]


def test_a_read_only_run_dir_is_refused_before_any_work(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    prefix = read_only(run_dir)
    cfg = toy_config(tmp_path, max_steps=3)
    proc = subprocess.run([*prefix, sys.executable, TOYS_PATH, json.dumps(cfg),
                           json.dumps({"fail_at": 1})],  # a step would raise "planted failure"
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert f"cannot write in {run_dir}" in proc.stderr and "planted failure" not in proc.stderr


class LearningRates(Callback):
    def __init__(self):
        self.seen = {}

    def on_log(self, view, metrics):
        self.seen[view.step] = metrics["train/lr"]


SCHEDULES = {
    "none": None,
    "step": {"_target_": "torch.optim.lr_scheduler.StepLR", "step_size": 3, "gamma": 0.5},
    "warmup_cosine": {"_target_": "saferun.schedules.warmup_cosine", "warmup_steps": 6,
                      "total_steps": 10},
}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_force_resume_trains_with_the_new_optimizer_settings(tmp_path, schedule):
    def run(name, steps, resume=None, **optim):
        cfg = toy_config(tmp_path, max_steps=steps, save_every_n_steps=4, log_every_n_steps=1)
        cfg["trainer"]["run_dir"] = str(tmp_path / name)
        cfg.update(optim={"_target_": "torch.optim.SGD", "momentum": 0.9, **optim},
                   sched=SCHEDULES[schedule], resume=resume, force_resume=resume is not None)
        lrs = LearningRates()
        trainer = ToyTrainer(cfg, callbacks=[lrs])
        trainer.fit()
        return trainer, lrs.seen

    run("a", 4, lr=0.05)
    new = dict(lr=0.02, weight_decay=1e-3)
    resumed, resumed_lrs = run("a", 10, resume="auto", **new)
    straight, straight_lrs = run("b", 10, **new)  # configured so from the start
    assert resumed_lrs == {s: lr for s, lr in straight_lrs.items() if s > 4}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in resumed.optimizer.param_groups]
    assert groups == [{k: v for k, v in g.items() if k != "params"}
                      for g in straight.optimizer.param_groups]
    if schedule != "none":
        assert resumed.scheduler.state_dict() == straight.scheduler.state_dict()
    # the optimizer's moments went on from the checkpoint's: the weights differ from both
    # a fresh start and the reference (trained 4 steps at the old rate)
    assert not torch.equal(resumed.model.head.weight, straight.model.head.weight)
    config = (tmp_path / "a" / "config.yaml").read_text()
    assert "lr: 0.02" in config and "weight_decay: 0.001" in config


def test_force_resume_refuses_a_new_lr_under_a_plateau_schedule(tmp_path):
    def cfg(lr, resume=None):
        c = toy_config(tmp_path, max_steps=4, val_every_n_steps=2, sched_metric="val/loss")
        c.update(optim={"_target_": "torch.optim.SGD", "lr": lr}, resume=resume, force_resume=True,
                 sched={"_target_": "torch.optim.lr_scheduler.ReduceLROnPlateau", "patience": 0})
        return c

    ToyTrainer(cfg(0.05)).fit()
    with pytest.raises(saferun.ConfigError, match="ReduceLROnPlateau schedule: its rate depends"):
        ToyTrainer(cfg(0.02, resume="auto")).fit()
    assert "lr: 0.05" in (tmp_path / "run" / "config.yaml").read_text()
