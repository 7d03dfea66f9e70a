"""Real signals to a real `saferun run`: the first stops at a step boundary with a checkpoint
and exit status 128 + n; a second Ctrl-C aborts at once (killed by SIGINT) before that
checkpoint is complete, and exits 130 at once after it; earlier checkpoints stay intact."""

import os
import signal
import subprocess
import sys
import time

import pytest

from saferun.checkpoint import list_checkpoints, load_checkpoint

# A copied recipe (as `saferun new` makes) whose step 5 waits for the test: the test's
# signals land mid-step; optional plants send the second SIGINT at exact points.
RECIPE = '''\
import os, signal, time

from torch.utils.data import dataloader

from saferun import Callback
from saferun.recipes.digits import DigitsTrainer

ARMED = []


def sigint_self():
    os.kill(os.getpid(), signal.SIGINT)


_shutdown = dataloader._MultiProcessingDataLoaderIter._shutdown_workers


def shutdown_workers(iterator):
    if ARMED:  # the first DataLoader shutdown after the held step: the loop is stopping
        ARMED.clear()
        sigint_self()
    _shutdown(iterator)


class SigintOnException(Callback):
    def on_exception(self, view, exc):  # after the stop's checkpoint is complete
        sigint_self()


class SlowDigits(DigitsTrainer):
    def __init__(self, cfg, hold_at=-1, second_sigint=None):
        super().__init__(cfg, callbacks=[SigintOnException()] if second_sigint == "saved" else [])
        self.hold_at = hold_at
        if second_sigint == "shutdown":
            dataloader._MultiProcessingDataLoaderIter._shutdown_workers = shutdown_workers

    def training_step(self, batch):
        if self.state.step + 1 == self.hold_at:
            run_dir = self.state.run_dir
            open(os.path.join(run_dir, "holding"), "w").close()
            for _ in range(3000):
                if os.path.exists(os.path.join(run_dir, "release")):
                    break
                time.sleep(0.02)
            ARMED.append(True)
        return super().training_step(batch)
'''

CONFIG = '''\
# @package _global_
# Digits whose step waits for the test (tests/cli/test_signals.py)
# Launch: saferun run -cd . recipe=slow
defaults:
  - override /model: digits
  - override /data: digits
name: slow
task:
  _target_: slow.SlowDigits
  hold_at: 5
trainer:
  max_steps: 8
  batch_size: 64
  num_workers: 2
  log_every_n_steps: 2
  save_every_n_steps: 2
  val_every_n_steps: 100
  limit_val_batches: 2
  progress_bar: false
'''


@pytest.fixture
def recipe(tmp_path):
    (tmp_path / "slow.py").write_text(RECIPE)
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "slow.yaml").write_text(CONFIG)
    return tmp_path


def start(cwd, *overrides):
    """`saferun run` in a session of its own (a terminal's foreground process group)."""
    err = open(cwd / "stderr.txt", "w")
    proc = subprocess.Popen([sys.executable, "-m", "saferun", "run", "-cd", ".", "recipe=slow",
                             "hydra.run.dir=run", *overrides], cwd=cwd, stdout=subprocess.DEVNULL,
                            stderr=err, start_new_session=True)
    err.close()
    return proc


def wait_until(condition, proc, what, seconds=240):
    for _ in range(seconds * 20):
        if condition():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended ({proc.returncode}) before {what}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"no {what} after {seconds} s")


def stderr(cwd):
    return (cwd / "stderr.txt").read_text()


def assert_intact(cwd, steps):
    """The checkpoints are these steps, each verifying against its manifest."""
    found = list_checkpoints(cwd / "run" / "checkpoints")
    assert [load_checkpoint(p)["loop"]["step"] for p in found] == steps


def test_second_ctrl_c_mid_step_aborts_at_once_leaving_earlier_checkpoints_intact(recipe):
    proc = start(recipe)
    wait_until((recipe / "run" / "holding").exists, proc, "step 5")
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole process group
    wait_until(lambda: "SIGINT received" in stderr(recipe), proc, "the first SIGINT's notice")
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=120) == -signal.SIGINT, stderr(recipe)  # step 5 still holding
    assert "aborting now, without saving" in stderr(recipe)
    assert_intact(recipe, [2, 4])
    (recipe / "run" / "release").touch()  # the resumed run's step 5 need not wait
    resumed = subprocess.run([sys.executable, "-m", "saferun", "run", "-cd", ".", "recipe=slow",
                              "hydra.run.dir=run", "resume=auto"],
                             cwd=recipe, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "Resumed from" in resumed.stdout + resumed.stderr and "step 4" in resumed.stdout


@pytest.mark.parametrize("second, status, steps", [
    ("shutdown", -signal.SIGINT, [2, 4]),  # during the DataLoader's shutdown, before the save
    ("saved", 128 + signal.SIGINT, [2, 4, 5]),  # after the stop's checkpoint is complete
])
def test_second_ctrl_c_is_never_swallowed_and_the_status_says_whether_it_saved(
        recipe, second, status, steps):
    proc = start(recipe, f"+task.second_sigint={second}")
    wait_until((recipe / "run" / "holding").exists, proc, "step 5")
    os.killpg(proc.pid, signal.SIGINT)
    (recipe / "run" / "release").touch()
    assert proc.wait(timeout=120) == status, stderr(recipe)
    said = stderr(recipe)
    assert ("aborting now, without saving" in said) == (second == "shutdown")
    assert ("stopped by SIGINT at step 5" in said) == (second == "saved")
    assert_intact(recipe, steps)
