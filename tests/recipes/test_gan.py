"""The GAN recipe (several named optimizers): `saferun check` through the real CLI, golden first
losses, SIGKILL mid-epoch then resume (bitwise), real torchrun, and (slow) its quality."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import saferun
from recipe_tools import assert_golden_losses, build_recipe, saferun_run
from helpers import free_port

JOB = str(Path(__file__).with_name("gan_job.py"))

# train/loss/disc, train/loss/gen at steps 1-5 (in that order), recorded on CPU (torch 2.13, fp32, one
# thread) with seed 0, and a learning rate of 2e-3 so that the updates are large enough for
# rtol 1e-4 to notice a change in how the loop applies them.
GOLDEN_LOSSES = [1.400824, 0.649635, 1.294226, 0.617744, 1.253026, 0.583448,
                 1.290835, 0.566772, 1.336189, 0.590809]


class Curves(saferun.Callback):
    def __init__(self) -> None:
        self.points: list[float] = []

    def on_log(self, view, metrics):
        self.points += [metrics["train/loss/disc"], metrics["train/loss/gen"]]


def test_golden_file(tmp_path):
    """recipes/golden/gan.json (train/loss: the two losses' sum), the file `saferun new` copies."""
    assert_golden_losses("gan", tmp_path)


def test_golden_first_losses_of_each_optimizer(tmp_path):
    assert torch.get_num_threads() == 1  # set by tests/conftest.py; numerics depend on it
    curves = Curves()
    trainer = build_recipe("gan", tmp_path, "trainer.max_steps=5", "trainer.log_every_n_steps=1",
                           "optim.lr=2e-3", "task.sample_digits=0", callbacks=[curves])
    trainer.fit()
    assert curves.points == pytest.approx(GOLDEN_LOSSES, rel=1e-4)
    images = trainer.predict(trainer.val_loader.dataset)  # generated from the codes
    assert images.shape == (len(trainer.val_loader.dataset), 64) and images.abs().max() <= 1


@pytest.mark.slow  # like digits' and charlm's in tests/guards/test_check.py; tabular's is the default one
def test_saferun_check_passes(tmp_path):
    """`saferun check recipe=gan`, through the real CLI: every check passes, and the one-batch
    check says that each of the two optimizers moved its parameters."""
    proc = subprocess.run([sys.executable, "-m", "saferun", "check", "recipe=gan",
                           "task.sample_digits=0"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "14 checks: 14 passed, 0 warned, 0 failed." in proc.stdout, proc.stdout
    assert "several optimizers, each moves its parameters" in proc.stdout


# 1437 training images, one pass of codes (data.repeats=1), 32 per step: 44 steps per epoch.
# 60 steps cross the epoch boundary; the kill at step 55 is mid-epoch, after the checkpoint at
# step 50 (epoch 1, batch 6). A warm-up cosine schedule per optimizer: both schedulers resume.
JOB_OVERRIDES = ["trainer.max_steps=60", "trainer.save_every_n_steps=25", "trainer.shuffle=false",
                 "trainer.log_every_n_steps=10", "trainer.val_every_n_steps=30", "data.repeats=1",
                 "sched=cosine", "sched.warmup_steps=10"]


def job(run_dir, plant=None, *overrides, nproc=1):
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}"]
    return subprocess.run([*launcher, JOB, str(run_dir), json.dumps(plant or {}), *JOB_OVERRIDES,
                           *overrides], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def one_process(tmp_path):
    """The job in this process, one process over 32 images per step (the reference)."""
    trainer = build_recipe("gan", tmp_path, *JOB_OVERRIDES, "trainer.batch_size=32",
                           "task.sample_digits=0")
    metrics = trainer.fit()
    return {"model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict(),
            "scheduler": trainer.scheduler.state_dict(),
            "metrics": {k: v for k, v in metrics.items() if not k.startswith("perf/")}}


def assert_same_state(a, b, exact=True):
    """Equal nested states: every tensor (bitwise, or to float tolerance), every other value."""
    if isinstance(a, torch.Tensor):
        if exact:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same_state(a[k], b[k], exact)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_state(x, y, exact)
    else:
        assert a == b or (exact is False and a == pytest.approx(b, rel=1e-4))


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_equals_the_uninterrupted_run_bitwise(tmp_path):
    """Parameters, buffers, both optimizers' and both schedulers' states, the final metrics.
    (Slow: three processes. The default suite's fast slice: tests/loop/test_optimizers.py's
    in-process resume by name.)"""
    assert job(tmp_path / "straight", None, "trainer.batch_size=32").returncode == 0
    straight = torch.load(tmp_path / "straight" / "final_rank0.pt", weights_only=False)
    run_dir = tmp_path / "run"
    killed = job(run_dir, {"kill_at": 55}, "trainer.batch_size=32")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = job(run_dir, None, "trainer.batch_size=32", "resume=auto")
    assert resumed.returncode == 0, resumed.stderr
    assert "Resumed from" in resumed.stdout and "step-00000050" in resumed.stdout
    state = torch.load(run_dir / "final_rank0.pt", weights_only=False)
    assert list(state["optimizer"]["named"]) == ["disc", "gen"]
    assert list(state["scheduler"]["named"]) == ["disc", "gen"]
    assert_same_state(state, straight)


def test_torchrun_two_ranks_agree_and_equal_one_process_over_the_global_batch(tmp_path):
    run_dir = tmp_path / "ddp"
    proc = job(run_dir, None, "trainer.batch_size=16", nproc=2)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    straight = one_process(tmp_path / "one")
    r0, r1 = (torch.load(run_dir / f"final_rank{r}.pt", weights_only=False) for r in (0, 1))
    assert_same_state(r0["model"], r1["model"])  # the ranks hold one model, bitwise
    assert_same_state(r0["optimizer"], r1["optimizer"])
    # shuffle off: rank r's batch j holds samples 32j + r, 32j + r + 2, ...; together the
    # single process's batch j. Averaging two means of 16 rounds differently from one of 32.
    assert_same_state(r0["model"], straight["model"], exact=False)
    assert_same_state(r0["optimizer"], straight["optimizer"], exact=False)
    assert_same_state(r0["metrics"], straight["metrics"], exact=False)


@pytest.mark.slow
def test_generated_digits_are_digits_of_every_class(tmp_path):
    """The recipe's promise, judged by a classifier trained on the real digits (an MLP: 87% of
    held-out real digits get a label with probability >= 0.9, uniform noise 7%): at least 60%
    of 1000 generated images get one (measured 75%), and at least 9 of the 10 classes hold 2%
    or more of those (measured: all 10, the rarest 2.7%): digits, not a collapsed mode."""
    from sklearn.datasets import load_digits
    from sklearn.neural_network import MLPClassifier

    saferun_run("recipe=gan", "task.sample_digits=0", run_dir=tmp_path / "run", timeout=900)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["step"] == 3000
    from saferun.recipes.gan import DigitsGAN
    gan = DigitsGAN()
    gan.load_state_dict(torch.load(tmp_path / "run" / "model.pt", weights_only=True))
    digits = load_digits()
    judge = MLPClassifier((128,), max_iter=500, random_state=0).fit(
        digits.images.reshape(-1, 64) / 8.0 - 1.0, digits.target)
    with torch.no_grad():
        fake = gan.generator(torch.randn(1000, gan.latent_dim,
                                         generator=torch.Generator().manual_seed(123))).numpy()
    probs = judge.predict_proba(fake)
    confident = probs.max(axis=1) >= 0.9
    assert confident.mean() >= 0.6
    shares = np.bincount(probs.argmax(axis=1)[confident], minlength=10) / confident.sum()
    assert (shares >= 0.02).sum() >= 9, shares


def test_force_resume_with_a_new_learning_rate_applies_it_to_both_optimizers(tmp_path):
    build_recipe("gan", tmp_path, "trainer.max_steps=4", "task.sample_digits=0").fit()
    resumed = build_recipe("gan", tmp_path, "trainer.max_steps=6", "task.sample_digits=0",
                           "optim.lr=3e-4", "resume=auto", "force_resume=true")
    resumed.fit()
    assert resumed.state.step == 6
    for name in ("disc", "gen"):  # the configured rate, and each optimizer's own moments
        assert resumed.optimizer[name].param_groups[0]["lr"] == 3e-4
        assert resumed.optimizer[name].state_dict()["state"][0]["step"] == 6
