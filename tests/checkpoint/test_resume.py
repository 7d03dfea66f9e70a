"""Exact resume after SIGKILL, preemption by SIGTERM/SIGINT, and config checks on resume."""

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import saferun
from saferun.checkpoint import list_checkpoints, load_checkpoint
from toys import METRICS, TOYS_PATH, ToyTrainer, toy_config

# 128 samples / 16 = 8 steps per epoch: 20 steps cross two epoch boundaries, and step 13
# (where the run is killed) is mid-epoch, between the checkpoints at steps 10 and 15.
# With a weight average (trainer.ema) and stateful metrics: they resume exactly too.
def config(run_dir, **kw):
    cfg = toy_config(run_dir.parent, max_steps=20, batch_size=16, num_workers=2,
                     save_every_n_steps=5, log_every_n_steps=3, val_every_n_steps=6,
                     ema={"decay": 0.8}, tensorboard=True, **kw)
    cfg["trainer"]["run_dir"] = str(run_dir)
    cfg["metrics"] = METRICS
    cfg["logger"] = {**cfg["logger"], "jsonl": {"_target_": "saferun.loggers.MetricsJsonl"}}
    return cfg


def train(cfg, signal_at=None, signum=None, where="training"):
    plant = {} if signal_at is None else {"signal_at": signal_at, "signum": int(signum),
                                          "in_validation": where == "validation"}
    return subprocess.run([sys.executable, TOYS_PATH, json.dumps(cfg), json.dumps(plant)],
                          capture_output=True, text=True, timeout=300)


def final_weights(run_dir):
    return torch.load(run_dir / "final_weights_rank0.pt", weights_only=True)


def assert_bitwise_equal(a, b):
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def tensorboard_events(run_dir):
    """({scalar tag: [(step, value)]}, {every tag: [steps]}) from the run's event files."""
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    steps = {tag: [step for step, _ in points] for tag, points in scalars.items()}
    steps.update({tag: [e.step for e in acc.Tensors(tag)] for tag in acc.Tags()["tensors"]})
    return scalars, steps


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    proc = train(config(run_dir))
    assert proc.returncode == 0, proc.stderr
    return run_dir


@pytest.fixture(scope="module")
def uninterrupted(straight_run):
    return final_weights(straight_run)


def test_sigkill_mid_epoch_then_resume_gives_bitwise_identical_weights(tmp_path, uninterrupted,
                                                                       straight_run):
    run_dir = tmp_path / "run"
    killed = train(config(run_dir), 13, signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == [
        "step-00000005", "step-00000010"]
    cfg = config(run_dir)
    cfg["resume"] = "auto"
    resumed = train(cfg)
    assert resumed.returncode == 0, resumed.stderr
    assert "Resumed from" in resumed.stdout and "step 10, epoch 1, batch 2" in resumed.stdout
    assert_bitwise_equal(final_weights(run_dir), uninterrupted)
    ema = [torch.load(d / "final_ema_rank0.pt", weights_only=True) for d in (run_dir, straight_run)]
    assert_bitwise_equal(*ema)  # the weight average: checkpointed and resumed exactly
    assert_bitwise_equal(torch.load(run_dir / "model_ema.pt"), torch.load(straight_run / "model_ema.pt"))
    # TensorBoard: the killed run's events after step 10 are gone, every tag holds each step
    # once (two event files, and the resumed run's HParams entry), and the curves are the
    # uninterrupted run's (but throughput)
    assert sorted(p.suffix == ".hparams" for p in (run_dir / "tensorboard").iterdir()) == [
        False, False, True]
    scalars, steps = tensorboard_events(run_dir)
    assert all(len(set(s)) == len(s) for s in steps.values()), steps
    straight = tensorboard_events(straight_run)[0]
    assert {t: v for t, v in scalars.items() if not t.startswith("perf/")} == \
        {t: v for t, v in straight.items() if not t.startswith("perf/")}
    assert scalars["train/loss"][-1][0] == 20 and scalars["val/acc"][1][0] == 12
    assert {"val/f1", "val/auroc", "val_ema/acc", "val_ema/f1"} <= set(scalars)
    # metrics.jsonl: the killed run's lines after the checkpoint were cut, the rest is the same
    lines = [[without_timings(json.loads(line)) for line in (d / "metrics.jsonl").read_text().splitlines()]
             for d in (run_dir, straight_run)]
    assert lines[0] == lines[1] and [x["step"] for x in lines[0] if x["kind"] == "val"] == [6, 12, 18, 20]


@pytest.mark.parametrize("signum, where, then_resume", [
    (signal.SIGTERM, "training", True), (signal.SIGTERM, "validation", True),
    (signal.SIGINT, "training", False)])
def test_signal_saves_at_the_boundary_exits_128_plus_n_and_resumes_exactly(
        tmp_path, uninterrupted, signum, where, then_resume):
    run_dir = tmp_path / "run"
    # in validation: during the validation after step 6; in training: during step 8,
    # the epoch's last (the signal lands in training_step, the save after the step)
    at, saved = (6, 6) if where == "validation" else (8, 8)
    stopped = train(config(run_dir), at, signum, where)
    assert stopped.returncode == 128 + signum, stopped.stderr
    assert f"stopped by {signal.Signals(signum).name} at step {saved}" in stopped.stderr
    assert "resume=auto" in stopped.stderr
    newest = list_checkpoints(run_dir / "checkpoints")[-1]
    assert load_checkpoint(newest)["loop"]["step"] == saved
    if not then_resume:
        return
    cfg = config(run_dir)
    cfg["resume"] = "auto"
    resumed = train(cfg)
    assert resumed.returncode == 0, resumed.stderr
    assert_bitwise_equal(final_weights(run_dir), uninterrupted)


def test_resume_in_process_equals_straight_run_without_workers(tmp_path):
    def cfg(run_dir, steps, resume=None):
        c = toy_config(tmp_path, max_steps=steps, save_every_n_steps=4, log_every_n_steps=3)
        c["trainer"]["run_dir"] = str(run_dir)
        c["resume"] = resume
        return c

    from toys import AugmentedTrainer, weights

    straight = AugmentedTrainer(cfg(tmp_path / "a", 12))
    straight.fit()
    first = AugmentedTrainer(cfg(tmp_path / "b", 6))  # stops at 6; the checkpoint is at step 6
    first.fit()
    second = AugmentedTrainer(cfg(tmp_path / "b", 12, resume="auto"))
    metrics = second.fit()
    assert second.state.step == 12
    assert_bitwise_equal(weights(second), weights(straight))
    assert metrics["train/loss"] == straight.state.metrics["train/loss"]  # same logged means


def test_resume_with_a_different_config_is_refused_naming_the_keys(tmp_path):
    ToyTrainer(toy_config(tmp_path, max_steps=4)).fit()
    changed = toy_config(tmp_path, max_steps=8, batch_size=16)
    changed["seed"] = 7
    changed["resume"] = "auto"
    with pytest.raises(saferun.ConfigError) as e:
        ToyTrainer(changed).fit()
    assert "seed: 0 -> 7" in str(e.value) and "trainer.batch_size: 32 -> 16" in str(e.value)
    assert "force_resume=true" in str(e.value)
    changed["force_resume"] = True
    t = ToyTrainer(changed)
    t.fit()
    assert t.state.step == 8


@pytest.mark.parametrize("before, after, named", [
    ({"nonfinite": "skip"}, {"nonfinite": "raise"}, "guards.nonfinite: 'skip' -> 'raise'"),
    ({"spikes": "skip"}, {"spikes": "skip", "spike_threshold": 3.0},
     "guards.spike_threshold: 6.0 -> 3.0"),
    ({"spikes": "rollback"}, {"spikes": "rollback", "spike_threshold": 3.0},
     "guards.spike_threshold: 6.0 -> 3.0"),
])
def test_resume_with_a_different_skip_policy_is_refused(tmp_path, before, after, named):
    cfg = toy_config(tmp_path, max_steps=4)
    cfg["guards"] = before
    ToyTrainer(cfg).fit()
    cfg = toy_config(tmp_path, max_steps=8)
    cfg["guards"], cfg["resume"] = after, "auto"
    with pytest.raises(saferun.ConfigError, match="cannot resume exactly") as e:
        ToyTrainer(cfg).fit()
    assert named in str(e.value)


def test_spike_settings_do_not_matter_on_resume_when_spikes_are_only_reported(tmp_path):
    cfg = toy_config(tmp_path, max_steps=4)
    ToyTrainer(cfg).fit()
    cfg = toy_config(tmp_path, max_steps=6)
    cfg["guards"], cfg["resume"] = {"spike_threshold": 3.0}, "auto"  # spikes=off: no effect
    t = ToyTrainer(cfg)
    t.fit()
    assert t.state.step == 6


def test_resume_auto_without_checkpoint_starts_fresh_and_explicit_path_must_exist(tmp_path):
    cfg = toy_config(tmp_path, max_steps=3)
    cfg["resume"] = "auto"
    t = ToyTrainer(cfg)
    t.fit()
    assert t.state.step == 3
    cfg["resume"] = str(tmp_path / "nowhere")
    with pytest.raises(saferun.SaferunError, match="nowhere does not exist"):
        ToyTrainer(cfg).fit()


def test_resume_from_an_explicit_checkpoint_directory(tmp_path):
    ToyTrainer(toy_config(tmp_path, max_steps=6, save_every_n_steps=2)).fit()
    step4 = tmp_path / "run" / "checkpoints" / "step-00000004"
    cfg = toy_config(tmp_path, max_steps=6)
    cfg["trainer"]["run_dir"] = str(tmp_path / "other")
    cfg["resume"] = str(step4)
    t = ToyTrainer(cfg)
    t.fit()
    assert t.state.step == 6
    assert (tmp_path / "other" / "checkpoints" / "step-00000006").is_dir()


def test_resume_from_an_older_checkpoint_sets_the_newer_ones_aside(tmp_path):
    # a run to step 8, then resumed from its step 4 with another learning rate: its old
    # steps 6 and 8 belong to the first timeline, and a later resume=auto must not pick them
    from toys import weights

    ToyTrainer(toy_config(tmp_path, max_steps=8, save_every_n_steps=2, keep_last=10)).fit()
    root = tmp_path / "run" / "checkpoints"
    old8 = load_checkpoint(root / "step-00000008")
    cfg = toy_config(tmp_path, max_steps=6, save_every_n_steps=2, keep_last=10)
    cfg["optim"]["lr"], cfg["force_resume"] = 0.2, True
    cfg["resume"] = str(root / "step-00000004")
    ToyTrainer(cfg).fit()
    assert [p.name for p in list_checkpoints(root)] == ["step-00000002", "step-00000004",
                                                        "step-00000006"]
    aside = [p / "checkpoints" for p in root.parent.iterdir() if p.name.startswith("superseded-")]
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == \
        ["step-00000006", "step-00000008"]
    assert torch.equal(load_checkpoint(aside[0] / "step-00000008")["model"]["head.weight"],
                       old8["model"]["head.weight"])  # moved, not rewritten
    cfg["resume"], cfg["trainer"]["max_steps"] = "auto", 8
    cont = ToyTrainer(cfg)
    cont.fit()  # continues the second timeline from its step 6
    assert cont.state.step == 8
    assert not torch.equal(weights(cont)["head.weight"], old8["model"]["head.weight"])
    second = load_checkpoint(root / "step-00000008")
    assert second["optimizer"]["param_groups"][0]["lr"] == 0.2


def test_a_changed_weight_average_refuses_resume(tmp_path):
    cfg = toy_config(tmp_path, max_steps=4)
    cfg["trainer"]["ema"] = {"decay": 0.99}
    ToyTrainer(cfg).fit()
    cfg = toy_config(tmp_path, max_steps=6)
    cfg["trainer"]["ema"], cfg["resume"] = {"decay": 0.5}, "auto"
    with pytest.raises(saferun.ConfigError, match="trainer.ema"):
        ToyTrainer(cfg).fit()


def test_second_sigint_aborts_at_once(tmp_path):
    script = f"""
import os, signal, sys
sys.path.insert(0, {os.path.dirname(TOYS_PATH)!r})
from toys import ToyTrainer, toy_config
class Twice(ToyTrainer):
    def training_step(self, batch):
        if self.state.step == 2:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return super().training_step(batch)
Twice(toy_config(__import__('pathlib').Path({str(tmp_path)!r}), max_steps=10)).fit()
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGINT, proc.stderr  # killed by it, as without saferun
    assert "second SIGINT: aborting now, without saving" in proc.stderr
    assert "stopped by SIGINT" not in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing saved: an abort


def start(cfg, plant):
    """The toy run in a session (process group) of its own, as a scheduler starts a job."""
    return subprocess.Popen([sys.executable, TOYS_PATH, json.dumps(cfg), json.dumps(plant)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def wait_for(path, proc, seconds=240):
    for _ in range(seconds * 20):
        if path.exists():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before {path.name}:\n{proc.communicate()[1]}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"no {path} after {seconds} s")


@pytest.mark.parametrize("context, signum", [
    ("fork", signal.SIGTERM),
    # slow: spawn workers import torch at every epoch (about a minute on 2 shared cores)
    pytest.param("spawn", signal.SIGTERM, marks=pytest.mark.slow),
    pytest.param("fork", signal.SIGINT, marks=pytest.mark.slow)])
def test_signal_to_the_whole_process_group_mid_step_saves_that_step_and_resumes_exactly(
        tmp_path, uninterrupted, context, signum):
    # What schedulers (SIGTERM) and terminals (Ctrl-C) do: the signal also reaches the
    # DataLoader workers. It lands in the middle of step 5, in the first epoch (whose spawn
    # workers start with the process's multiprocessing resource tracker).
    run_dir = tmp_path / "run"
    proc = start(config(run_dir, multiprocessing_context=context), {"hold_at": 5})
    wait_for(run_dir / "holding", proc)
    os.killpg(proc.pid, signum)
    (run_dir / "release").touch()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signum, err
    assert f"stopped by {signal.Signals(signum).name} at step 5" in err
    loop = load_checkpoint(list_checkpoints(run_dir / "checkpoints")[-1])["loop"]
    assert (loop["step"], loop["epoch"], loop["batches_in_epoch"]) == (5, 0, 5)
    cfg = config(run_dir, multiprocessing_context=context)
    cfg["resume"] = "auto"
    resumed = train(cfg)
    assert resumed.returncode == 0, resumed.stderr
    assert_bitwise_equal(final_weights(run_dir), uninterrupted)


def assert_same(a, b, path="state"):
    """Nested dicts, lists and tensors equal bitwise (tensors) or exactly (the rest)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (path, list(a), list(b))
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


def final_state(run_dir):
    """The final checkpoint's training state, with run-directory paths reduced to names."""
    state = load_checkpoint(list_checkpoints(run_dir / "checkpoints")[-1])
    best = state["loop"]["best"]
    state["loop"]["best"] = [best[0], os.path.basename(best[1]), *best[2:]] if best else None
    del state["config"], state["provenance"]  # run_dir and resume differ, by design
    for name, kept in state["callbacks"].items():
        if name.endswith(":MetricsJsonl"):  # bytes written: the perf/ timings' digits vary
            kept.pop("length")
    return without_timings(state)


def without_timings(obj):
    """`obj` without the perf/ entries (timings) and metrics.jsonl's time wherever they are kept."""
    if isinstance(obj, dict):
        return {k: without_timings(v) for k, v in obj.items()
                if not str(k).startswith("perf/") and k != "time"}
    return obj


def val_curves(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["scalars"] if tag.startswith("val/")}


def validating_config(run_dir, resume=None):
    """128 samples / 16: 8 steps per epoch; validation at 6, 12, 18 and at the end (20);
    step 12 is also a save step; EarlyStopping and save_best keep state from validations."""
    c = toy_config(run_dir.parent, tensorboard=True, max_steps=20, batch_size=16,
                   save_every_n_steps=4, log_every_n_steps=3, val_every_n_steps=6,
                   save_best="val/loss", run_dir=str(run_dir))
    c["callbacks"] = {"early_stopping": {"_target_": "saferun.stopping.EarlyStopping",
                                         "monitor": "val/acc", "mode": "max", "patience": 9}}
    c["resume"] = resume
    return c


@pytest.mark.parametrize("at", [12, 20])  # a validation in the loop; the final one
def test_sigterm_during_validation_is_owed_and_the_resumed_run_validates_first(tmp_path, at):
    from saferun.preemption import Preempted
    from toys import SelfSignalling

    cfg = validating_config
    SelfSignalling(cfg(tmp_path / "straight")).fit()
    stopped = SelfSignalling(cfg(tmp_path / "run"), signal_at=at, signum=signal.SIGTERM,
                             in_validation=True)
    with pytest.raises(Preempted) as e:
        stopped.fit()
    assert e.value.code == 143 and f"at step {at} (its validation was interrupted" in str(e.value)
    owed = load_checkpoint(list_checkpoints(tmp_path / "run" / "checkpoints")[-1])["loop"]["owed"]
    assert owed == {"step": at, "save": False, "stop": at == 20}
    resumed = SelfSignalling(cfg(tmp_path / "run", resume="auto"))
    resumed.fit()
    assert val_curves(tmp_path / "run") == val_curves(tmp_path / "straight")
    assert [s for s, _ in val_curves(tmp_path / "run")["val/loss"]] == [6, 12, 18, 20]
    assert_same(final_state(tmp_path / "run"), final_state(tmp_path / "straight"))


def test_resuming_a_finished_run_does_not_redo_its_final_validation(tmp_path):
    # what a resume=auto after a stop that came once the final checkpoint was written does
    from toys import SelfSignalling

    run_dir = tmp_path / "run"
    SelfSignalling(validating_config(run_dir)).fit()
    curves, state = val_curves(run_dir), final_state(run_dir)
    SelfSignalling(validating_config(run_dir, resume="auto")).fit()
    assert val_curves(run_dir) == curves
    assert_same(final_state(run_dir), state)


@pytest.fixture(scope="module")
def validated_straight(tmp_path_factory):
    from toys import SelfSignalling

    run_dir = tmp_path_factory.mktemp("validated") / "straight"
    SelfSignalling(validating_config(run_dir)).fit()
    return tensorboard_events(run_dir)


class _FitStart(saferun.Callback):
    def on_fit_start(self, view):
        self.at = time.time()


# resume=auto: from the checkpoint the failure at step 19 saved (step 18, logged and validated
# before it); resume=PATH: back to step 12, its course's events up to 12 copied under their
# names, then this run's.
@pytest.mark.parametrize("resume", ["auto", pytest.param("step-00000012", marks=pytest.mark.slow)])
def test_a_resumed_writer_whose_file_would_sort_before_the_earlier_ones_shows_each_step_once(
        tmp_path, validated_straight, resume):
    # TensorBoard reads event files in name order, and a name starts with the second it was
    # opened, then host, pid and a counter: a resume within the earlier writer's second can sort
    # first (pid 1000 < 999, .10 < .9). Read first, the resumed run's steps would then be
    # purged by the earlier file's own START (step 0), and the steps it logged after the
    # earlier run stopped would be lost. Planted: the earlier run's file is renamed seconds
    # ahead, where the resumed writer's file sorts first.
    from saferun.errors import ExplainedRuntimeError
    from toys import SelfSignalling

    run_dir = tmp_path / "run"
    with pytest.raises(ExplainedRuntimeError, match="planted failure"):
        SelfSignalling(validating_config(run_dir), fail_at=19).fit()
    (earlier,) = [p for p in (run_dir / "tensorboard").iterdir() if not p.name.endswith(".hparams")]
    assert tensorboard_events(run_dir)[1]["val/loss"] == [6, 12, 18]  # then the failure at 19
    parts = earlier.name.split(".")
    ahead = int(time.time() + 3)
    parts[3] = "%010d" % ahead
    planted = ".".join(parts)
    earlier.rename(earlier.with_name(planted))
    path = resume if resume == "auto" else str(run_dir / "checkpoints" / resume)
    opened = _FitStart()  # a user callback's on_fit_start runs before the logger opens its file
    SelfSignalling(validating_config(run_dir, resume=path), callbacks=[opened]).fit()
    if int(opened.at) >= ahead:  # the resumed writer's own name sorted last: nothing was planted
        pytest.skip(f"the resumed run took {opened.at - ahead + 3:.1f} s to reach its writer: "
                    f"the planted name ({ahead}) no longer sorts after a new file's")

    scalars, steps = tensorboard_events(run_dir)
    assert all(len(set(s)) == len(s) for s in steps.values()), steps
    straight = validated_straight[0]
    # the uninterrupted run's curves: every tag, every step; values but the timings' (perf/)
    assert {t: v if not t.startswith("perf/") else [s for s, _ in v] for t, v in scalars.items()} == \
        {t: v if not t.startswith("perf/") else [s for s, _ in v] for t, v in straight.items()}
    assert scalars["train/loss"][-1][0] == 20 and [s for s, _ in scalars["val/loss"]] == [6, 12, 18, 20]
    files = sorted(p.name for p in (run_dir / "tensorboard").iterdir() if not p.name.endswith(".hparams"))
    assert len(files) == 2 and files[0] == planted, files  # the resumed run's file sorts last


def test_a_run_whose_shielded_workers_outlive_fit_still_exits(tmp_path):
    # Persistent workers live as long as their loader (here, to interpreter exit), where
    # multiprocessing ends them with SIGTERM, which shielded workers do not act on.
    script = f"""
import sys
sys.path.insert(0, {os.path.dirname(TOYS_PATH)!r})
from pathlib import Path
from torch.utils.data import DataLoader
from toys import AugmentedTrainer, toy_config
class Persistent(AugmentedTrainer):
    def build_dataloaders(self, train, val):
        return DataLoader(train, batch_size=16, num_workers=2, persistent_workers=True), None
trainer = Persistent(toy_config(Path({str(tmp_path)!r}), max_steps=10))
trainer.fit()
"""
    try:
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=120)
    except subprocess.TimeoutExpired:
        raise AssertionError("the process did not exit: its DataLoader workers outlived it") from None
    assert proc.returncode == 0, proc.stderr
    assert "Exception ignored" not in proc.stderr and "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("finished")
    ToyTrainer(toy_config(tmp_path, max_steps=2)).fit()
    return tmp_path


@pytest.mark.parametrize("change, key", [
    ({"seed": 1}, "seed"),
    ({"model": {"_target_": "toys.Net", "hidden": 8}}, "model._target_"),
    ({"data": {"_target_": "toys.make_classification"}}, "data._target_"),
    ({"task": {"_target_": "toys.ToyTrainer"}}, "task._target_"),
    ({"collate_fn": {"_target_": "torch.utils.data.default_collate", "_partial_": True}},
     "collate_fn._target_"),
    ({"optim": {"_target_": "torch.optim.SGD", "lr": 0.1}}, "optim.lr"),
    ({"sched": {"_target_": "torch.optim.lr_scheduler.StepLR", "step_size": 2}}, "sched._target_"),
    ({"trainer": {"batch_size": 16}}, "trainer.batch_size"),
    ({"trainer": {"accumulate": 2}}, "trainer.accumulate"),
    ({"trainer": {"num_workers": 2}}, "trainer.num_workers"),
    ({"trainer": {"shuffle": False}}, "trainer.shuffle"),
    ({"trainer": {"drop_last": True}}, "trainer.drop_last"),
    ({"trainer": {"precision": "bf16"}}, "trainer.precision"),
    ({"trainer": {"frozen_modules": ["head"]}}, "trainer.frozen_modules"),
    ({"trainer": {"max_grad_norm": None}}, "trainer.max_grad_norm"),
    ({"guards": {"nonfinite": "skip"}}, "guards.nonfinite"),
    ({"guards": {"spikes": "raise"}}, "guards.spikes"),
])
def test_each_setting_that_changes_results_refuses_resume(finished_run, change, key):
    cfg = toy_config(finished_run, max_steps=4)
    for group, value in change.items():
        if group in ("trainer", "guards"):
            cfg.setdefault(group, {}).update(value)
        else:
            cfg[group] = value
    cfg["resume"] = "auto"
    named = rf"differs from the checkpoint's in .*\b{re.escape(key)}: "
    with pytest.raises(saferun.ConfigError, match=named):
        ToyTrainer(cfg).fit()


def test_a_signal_during_validation_stops_it_before_the_next_batch(tmp_path):
    from saferun.preemption import Preempted

    class SignalInValidation(ToyTrainer):
        calls = 0

        def validation_step(self, batch):
            self.calls += 1
            if self.calls == 1:
                os.kill(os.getpid(), signal.SIGTERM)  # a real signal, in this process
            return super().validation_step(batch)

    t = SignalInValidation(toy_config(tmp_path, max_steps=10, val_every_n_steps=2,
                                      val_batch_size=8))  # 8 validation batches
    with pytest.raises(Preempted) as e:
        t.fit()
    assert e.value.code == 128 + signal.SIGTERM
    assert t.calls == 1  # checked between validation batches, not after the whole validation
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == ["step-00000002"]


def test_a_signal_during_a_step_saves_right_after_that_step(tmp_path):
    from saferun.preemption import Preempted

    class SignalAt5(ToyTrainer):
        def training_step(self, batch):
            if self.state.step + 1 == 5:
                os.kill(os.getpid(), signal.SIGTERM)
            return super().training_step(batch)

    t = SignalAt5(toy_config(tmp_path, max_steps=20, log_every_n_steps=4))
    with pytest.raises(Preempted) as e:
        t.fit()
    assert e.value.code == 128 + signal.SIGTERM and t.state.step == 5  # not at a log point
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == ["step-00000005"]


@pytest.mark.parametrize("key, value", [("val_every_n_steps", 3), ("limit_val_batches", 1),
                                        ("val_batch_size", 8)])
def test_a_resume_that_changes_what_validation_sees_is_refused_without_force_resume(tmp_path, key, value):
    # validation steers ReduceLROnPlateau (sched_metric), EarlyStopping and save_best: a
    # resume that validates at other steps or on other batches continues another run
    cfg = toy_config(tmp_path, max_steps=4, val_every_n_steps=2, save_best="val/loss")
    ToyTrainer(cfg).fit()
    cfg = toy_config(tmp_path, max_steps=6, val_every_n_steps=2, save_best="val/loss")
    cfg["trainer"][key], cfg["resume"] = value, "auto"
    with pytest.raises(saferun.ConfigError, match=rf"trainer\.{key}: .* -> {value}.*force_resume=true"):
        ToyTrainer(cfg).fit()
    cfg["force_resume"] = True
    t = ToyTrainer(cfg)
    t.fit()
    assert t.state.step == 6


def test_a_resume_that_finds_no_checkpoint_says_what_is_there_and_what_resume_accepts(tmp_path):
    # a recipe's parent folder holding two runs, a path that does not exist, and words
    # from other tools: each message says whether the path exists and what resume accepts
    for name in ("20260101-000000-ab12", "20260102-000000-cd34"):
        cfg = toy_config(tmp_path, max_steps=2)
        cfg["trainer"]["run_dir"] = str(tmp_path / "outputs" / "toy" / name)
        ToyTrainer(cfg).fit()
    accepts = "resume accepts auto"

    def refusal(resume):
        cfg = toy_config(tmp_path, max_steps=4)
        cfg["trainer"]["run_dir"], cfg["resume"] = str(tmp_path / "new"), resume
        with pytest.raises(saferun.SaferunError) as e:
            ToyTrainer(cfg).fit()
        return str(e.value)

    parent = refusal(str(tmp_path / "outputs" / "toy"))
    assert "exists" in parent and accepts in parent and "holds run directories" in parent
    assert f"resume={tmp_path / 'outputs' / 'toy' / '20260102-000000-cd34'}" in parent  # the newest
    missing = refusal(str(tmp_path / "nowhere"))
    assert "does not exist" in missing and accepts in missing and "did you mean" not in missing
    for word in ("latest", True, "last"):
        said = refusal(word)
        assert "does not exist" in said and accepts in said and "did you mean resume=auto" in said
        assert "?." not in said  # one sentence end
    file = tmp_path / "weights.pt"
    file.write_bytes(b"x")
    assert "is a file" in refusal(str(file))


def test_a_resume_with_another_number_of_threads_says_it_may_round_differently(tmp_path, caplog):
    # trainer.num_threads=auto plans from the cores free at start-up: a resume under another
    # load can get another count, whose CPU sums round differently from the uninterrupted run's
    ToyTrainer(toy_config(tmp_path, max_steps=4, num_threads=1)).fit()
    said = {}
    for threads, max_steps in ((1, 6), (2, 8)):
        cfg = toy_config(tmp_path, max_steps=max_steps, num_threads=threads)
        cfg["resume"] = "auto"
        caplog.clear()
        try:
            with caplog.at_level(logging.WARNING, logger="saferun"):
                ToyTrainer(cfg).fit()
        finally:
            torch.set_num_threads(1)  # (this process's: conftest's)
        said[threads] = [r.getMessage() for r in caplog.records if "compute threads" in r.getMessage()]
    assert said[1] == []  # the same count: nothing to say
    (message,) = said[2]  # the checkpoint of step 6 was written with 1
    assert "Resumed with 2 compute threads; the checkpoint's run used 1" in message
    assert "trainer.num_threads=1" in message
