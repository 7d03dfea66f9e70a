"""Crash-safe checkpoint files: atomic writes, verification, safe loading, rotation."""

import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import saferun

from saferun.checkpoint import (CheckpointError, check_plain, list_checkpoints, load_checkpoint,
                                load_latest, save_checkpoint)
from saferun.stopping import EarlyStopping
from toys import TOYS_PATH, ScaledOnCpu, SelfSignalling, ToyTrainer, toy_config, weights


def test_a_checkpoint_holds_the_whole_training_state(tmp_path):
    cfg = toy_config(tmp_path, max_steps=4, save_every_n_steps=2, precision="bf16")
    cfg["sched"] = {"_target_": "torch.optim.lr_scheduler.StepLR", "step_size": 1, "gamma": 0.9}
    t = ToyTrainer(cfg, callbacks=[EarlyStopping(patience=3)])
    t.fit()
    run = tmp_path / "run"
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step-00000002", "step-00000004"]
    state = load_checkpoint(run / "checkpoints" / "step-00000004")  # weights_only=True inside
    assert set(state) == {"format", "model", "optimizer", "scheduler", "scaler", "ema", "loop",
                          "per_rank", "layout", "callbacks", "config", "provenance"}
    assert state["layout"] == [1, 1]  # (data ranks, ranks): one process
    assert state["ema"] is None  # trainer.ema is off
    assert state["loop"]["step"] == 4 and state["loop"]["epoch"] == 0
    assert state["loop"]["batches_in_epoch"] == 4
    assert len(state["per_rank"]) == 1
    assert set(state["per_rank"][0]) == {"rng", "running", "spikes", "epoch_start"}
    assert set(state["per_rank"][0]["epoch_start"]) == {"rng", "generators", "samplers"}
    assert set(state["per_rank"][0]["rng"]) >= {"python", "numpy", "torch"}
    assert state["scheduler"]["last_epoch"] == 4
    assert state["config"]["trainer"]["precision"] == "bf16"
    assert state["provenance"]["torch"] == str(torch.__version__)
    assert state["callbacks"]["0:EarlyStopping(monitor='val/loss')"]["best"] == t.state.metrics["val/loss"]
    manifest = json.loads((run / "checkpoints" / "step-00000004" / "manifest.json").read_text())
    assert manifest["step"] == 4 and len(manifest["files"]["state.pt"]["sha256"]) == 64
    # the final weights, loadable without saferun
    plain = torch.load(run / "model.pt", weights_only=True)
    assert all(torch.equal(plain[k], v) for k, v in weights(t).items())


def test_corrupted_newest_checkpoint_falls_back_to_the_previous_with_a_warning(tmp_path, caplog):
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 1, {"x": torch.ones(3)})
    newest = save_checkpoint(root, 2, {"x": torch.full((3,), 2.0)})
    data = (newest / "state.pt").read_bytes()
    (newest / "state.pt").write_bytes(data[: len(data) // 2])  # truncated, as by a full disk
    with caplog.at_level(logging.WARNING, logger="saferun"):
        path, state = load_latest(root)
    assert path.name == "step-00000001" and torch.equal(state["x"], torch.ones(3))
    assert any("step-00000002" in r.getMessage() and "does not match its manifest" in r.getMessage()
               for r in caplog.records)


def test_a_checkpoint_without_manifest_is_incomplete(tmp_path):
    path = save_checkpoint(tmp_path, 3, {"x": torch.ones(1)})
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no manifest.json"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="every checkpoint .* is damaged"):
        load_latest(tmp_path)  # a step-* directory is only ever complete: it is damaged


class Payload:
    """What an attacker pickles: unpickling it would create a marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_crafted_checkpoint_is_refused_and_its_code_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    path = save_checkpoint(tmp_path / "checkpoints", 5, {"x": torch.ones(1)})
    # the attacker replaces the state and rewrites the manifest to match
    torch.save({"model": Payload(str(marker))}, path / "state.pt")
    from saferun.checkpoint.store import file_digest

    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["state.pt"] = {"bytes": (path / "state.pt").stat().st_size,
                                     "sha256": file_digest(path / "state.pt")[1]}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="refused to load.*Unsupported global"):
        load_checkpoint(path)
    cfg = toy_config(tmp_path, max_steps=2)
    cfg["resume"] = str(path)
    with pytest.raises(CheckpointError, match="refused to load"):
        ToyTrainer(cfg).fit()
    assert not marker.exists()


def test_state_that_would_not_load_safely_is_refused_at_save_time(tmp_path):
    with pytest.raises(CheckpointError, match=r"state\['callbacks'\]\['x'\] is a .*Payload"):
        save_checkpoint(tmp_path, 1, {"callbacks": {"x": Payload("m")}})
    assert not list(tmp_path.iterdir()) or not list_checkpoints(tmp_path)
    check_plain({"a": [1, 2.0, "s", None, torch.ones(1), (True,)]})  # all fine


def test_keep_last_and_best(tmp_path):
    class ValAccAt(ToyTrainer):
        """Validation accuracy scripted per step: best at step 4."""

        def validation_step(self, batch):
            return {"acc": torch.tensor({2: 0.5, 4: 0.9, 6: 0.6, 8: 0.7, 10: 0.8}[self.state.step])}

    t = ValAccAt(toy_config(tmp_path, max_steps=10, save_every_n_steps=2, val_every_n_steps=2,
                            keep_last=2, save_best="val/acc", save_best_mode="max"))
    t.fit()
    kept = [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")]
    assert kept == ["step-00000004", "step-00000008", "step-00000010"]


class ScoreAt(ToyTrainer):
    """Validation score scripted per step (lower is better): best at step 8."""

    crash_at = -1

    def training_step(self, batch):
        if self.state.step + 1 == self.crash_at:
            raise RuntimeError("simulated crash")
        return super().training_step(batch)

    def validation_step(self, batch):
        return {"score": torch.tensor({4: 5.0, 8: 3.0, 12: 4.0, 16: 6.0}[self.state.step])}


def test_the_best_checkpoint_records_itself_and_survives_a_resume(tmp_path):
    cfg = toy_config(tmp_path, max_steps=16, save_every_n_steps=None, val_every_n_steps=4,
                     keep_last=1, save_best="val/score", save_best_mode="min")
    root = tmp_path / "run" / "checkpoints"
    crashing = ScoreAt(cfg)
    crashing.crash_at = 9  # after the best checkpoint (step 8), before any other
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashing.fit()
    assert [p.name for p in list_checkpoints(root)] == ["step-00000008"]
    best = load_checkpoint(root / "step-00000008")["loop"]["best"]
    assert best == [3.0, str(root / "step-00000008"), 8]  # itself, not the previous best (step 4)
    cfg["resume"] = "auto"
    ScoreAt(cfg).fit()  # step 12 scores 4.0: better than step 4's 5.0, not than step 8's 3.0
    assert [p.name for p in list_checkpoints(root)] == ["step-00000008", "step-00000016"]
    assert load_checkpoint(root / "step-00000016")["loop"]["best"] == best


def test_a_writer_killed_mid_save_leaves_the_previous_checkpoint_intact(tmp_path):
    root = tmp_path / "checkpoints"
    script = f"""
import torch, sys
from pathlib import Path
from saferun.checkpoint import save_checkpoint
root = Path({str(root)!r})
save_checkpoint(root, 1, {{"x": torch.ones(4)}})
print("first saved", flush=True)
save_checkpoint(root, 2, {{"x": torch.ones(150_000_000)}})  # 600 MB: takes a while to write
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "first saved"
    deadline = time.time() + 60
    while not list(root.glob(".tmp-step-00000002-*")) and time.time() < deadline:
        time.sleep(0.001)
    proc.send_signal(signal.SIGKILL)  # mid-write: the temporary directory exists
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert [p.name for p in list_checkpoints(root)] == ["step-00000001"]
    path, state = load_latest(root)
    assert path.name == "step-00000001" and torch.equal(state["x"], torch.ones(4))


def test_callback_state_round_trips_through_a_checkpoint(tmp_path):
    stopper = EarlyStopping(monitor="val/acc", mode="max", patience=4)
    ToyTrainer(toy_config(tmp_path, max_steps=8, val_every_n_steps=2), callbacks=[stopper]).fit()
    assert stopper.best is not None
    cfg = toy_config(tmp_path, max_steps=8)
    cfg["resume"] = "auto"
    fresh = EarlyStopping(monitor="val/acc", mode="max", patience=4)
    t = ToyTrainer(cfg, callbacks=[fresh])
    t.load_state_dict(load_latest(tmp_path / "run" / "checkpoints")[1])
    assert (fresh.best, fresh.bad_validations) == (stopper.best, stopper.bad_validations)


class _Probe(saferun.Callback):
    """A callback with no state of its own, added or removed at a resume."""


def test_a_resume_with_a_callback_added_or_removed_gives_each_callback_its_own_state(
        tmp_path, caplog):
    # The states were keyed by the position in the whole list: a callback added in front at a
    # resume shifted the others, and EarlyStopping (and the loggers: the TensorBoard steps of
    # the checkpoint, MLflow's run) silently started over
    stopper = EarlyStopping(monitor="val/acc", mode="max", patience=4)
    ToyTrainer(toy_config(tmp_path, max_steps=8, val_every_n_steps=2),
               callbacks=[stopper, EarlyStopping(monitor="val/loss", patience=9)]).fit()
    saved = load_latest(tmp_path / "run" / "checkpoints")[1]
    on_loss = "0:EarlyStopping(monitor='val/loss')"
    assert saved["callbacks"][on_loss]["best"] is not None
    for front in ([_Probe()], [_Probe(), _Probe()], []):
        again = [EarlyStopping(monitor="val/acc", mode="max", patience=4),
                 EarlyStopping(monitor="val/loss", patience=9)]
        t = ToyTrainer(toy_config(tmp_path, max_steps=8), callbacks=front + again)
        t.load_state_dict(saved)
        assert (again[0].best, again[0].bad_validations) == (stopper.best, stopper.bad_validations)
        assert again[1].best == saved["callbacks"][on_loss]["best"]
    # the keys of earlier checkpoints (the list's index and the class: a probe in front made
    # EarlyStopping 1 and 2)
    old = {**saved, "callbacks": {f"{i + 1}:{k.split(':', 1)[1].split('(')[0]}": v
                                  for i, (k, v) in enumerate(saved["callbacks"].items())}}
    assert "1:EarlyStopping" in old["callbacks"] and "2:EarlyStopping" in old["callbacks"]
    again = [EarlyStopping(monitor="val/acc", mode="max", patience=4)]
    t = ToyTrainer(toy_config(tmp_path, max_steps=8), callbacks=again)
    with caplog.at_level(logging.WARNING, logger="saferun"):
        t.load_state_dict(old)
    assert again[0].best == stopper.best
    said = [r.getMessage() for r in caplog.records if "does not have" in r.getMessage()]
    assert len(said) == 1 and "EarlyStopping" in said[0] and "dropped" in said[0], said


class _WithError(ToyTrainer):
    """Validation also reports val/err (1 - acc): a second metric that is lower-is-better."""

    def validation_step(self, batch):
        out = super().validation_step(batch)
        return {**out, "err": 1 - out["acc"]}


def _stoppers(order):
    made = {"val/loss": EarlyStopping(monitor="val/loss", patience=50),
            "val/err": EarlyStopping(monitor="val/err", mode="min", patience=50)}
    return [made[m] for m in order], made


def test_two_early_stoppings_swapped_at_a_resume_each_continue_their_own_metric(tmp_path):
    # Keyed by class and place among that class, two EarlyStopping swapped in order at a resume
    # took each other's state: the one on val/err compared with val/loss's best (a same-mode
    # pair is not refused) and stopped the run early, or never, silently. A user reorders a
    # callback list without a thought; each must continue the metric it watches.
    cfg = dict(max_steps=12, val_every_n_steps=2, save_every_n_steps=4)
    reference, by_metric = _stoppers(["val/loss", "val/err"])
    _WithError(toy_config(tmp_path / "ref", **cfg), callbacks=reference).fit()
    first, _ = _stoppers(["val/loss", "val/err"])
    _WithError(toy_config(tmp_path, **{**cfg, "max_steps": 6}), callbacks=first).fit()
    resumed, mine = _stoppers(["val/err", "val/loss"])
    again = toy_config(tmp_path, **cfg)
    again["resume"] = "auto"
    _WithError(again, callbacks=resumed).fit()
    assert {m: cb.state_dict() for m, cb in mine.items()} == \
        {m: cb.state_dict() for m, cb in by_metric.items()}
    assert by_metric["val/loss"].best != by_metric["val/err"].best  # (the swap would show)


def test_resuming_a_finished_run_trains_no_further(tmp_path):
    ToyTrainer(toy_config(tmp_path, max_steps=4)).fit()
    cfg = toy_config(tmp_path, max_steps=4)
    cfg["resume"] = "auto"
    t = ToyTrainer(cfg)
    t.fit()
    assert t.state.step == 4


def assert_same_state(a, b, path="state"):
    """Nested dicts/lists of tensors and plain values, compared exactly (but timings)."""
    assert type(a) is type(b), path
    if isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            if str(k).startswith("perf/"):
                continue  # throughput: wall-clock, differs between any two runs
            assert_same_state(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), path
    else:
        assert a == b, path


def test_every_single_bit_flip_of_a_manifest_loads_the_same_state_or_falls_back(tmp_path):
    ToyTrainer(toy_config(tmp_path, max_steps=4, save_every_n_steps=2, keep_last=2)).fit()
    root = tmp_path / "run" / "checkpoints"
    older, newest = list_checkpoints(root)
    good = {p: load_checkpoint(p) for p in (older, newest)}
    manifest = (newest / "manifest.json").read_bytes()
    damaged = 0
    for bit in range(len(manifest) * 8):
        flipped = bytearray(manifest)
        flipped[bit // 8] ^= 1 << (bit % 8)
        (newest / "manifest.json").write_bytes(bytes(flipped))
        try:
            assert_same_state(load_checkpoint(newest), good[newest])
        except CheckpointError:  # any other exception fails the test
            damaged += 1
            if damaged % 50 == 1:  # and a resume falls back to the older one (a sample: 0.3 s each)
                path, state = load_latest(root)
                assert path == older
                assert_same_state(state, good[older])
    assert damaged > 0


@pytest.mark.parametrize("manifest", [
    {"format": 2, "step": 2, "files": {"state.pt": {"bytes": 1, "sha25": "0" * 64}}},
    {"format": 2, "step": 2, "files": {"state.pt": ["not", "an", "object"]}},
    {"format": 2, "step": 2, "files": []},
    [1, 2, 3],
    {"format": 2, "step": 3, "files": {"state.pt": {"bytes": 1, "sha256": "0" * 64}}},
    {"format": 1, "step": 2, "files": []},  # format 1, but not in format 1's shape either
    {"format": 3, "step": 2, "files": {"state.pt": {"bytes": 1, "sha256": "0" * 64}}},
])
def test_a_manifest_of_an_unexpected_shape_counts_as_damaged(tmp_path, manifest):
    save_checkpoint(tmp_path, 1, {"x": torch.ones(2)})
    path = save_checkpoint(tmp_path, 2, {"x": torch.zeros(2)})
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="manifest.json is damaged"):
        load_checkpoint(path)
    assert load_latest(tmp_path)[0].name == "step-00000001"


class CountingSteps(ToyTrainer):
    steps_run = 0

    def training_step(self, batch):
        type(self).steps_run += 1
        return super().training_step(batch)


def refused_resume(tmp_path, spoil) -> str:
    """A 4-step run's checkpoints, each spoiled by `spoil(path)`, then resume=auto: its refusal
    (after no step, with no file on disk changed)."""
    ToyTrainer(toy_config(tmp_path, max_steps=4, save_every_n_steps=2, keep_last=2)).fit()
    root = tmp_path / "run" / "checkpoints"
    for path in list_checkpoints(root):
        spoil(path)
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    cfg = toy_config(tmp_path, max_steps=8, save_every_n_steps=2)
    cfg["resume"] = "auto"
    CountingSteps.steps_run = 0
    with pytest.raises(CheckpointError) as e:
        CountingSteps(cfg).fit()
    assert CountingSteps.steps_run == 0  # nothing trained, nothing written
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before
    return str(e.value)


def test_a_checkpoint_of_the_unreleased_format_1_is_refused_saying_so_and_nothing_is_lost(tmp_path):
    def format_1(path):  # as a development version before 0.1.0 wrote them
        manifest = json.loads((path / "manifest.json").read_text())
        (path / "manifest.json").write_text(json.dumps({**manifest, "format": 1}))

    message = refused_resume(tmp_path, format_1)
    assert "written in checkpoint format 1, by a development version of saferun" in message
    assert "resume=fresh" in message


def test_resume_auto_refuses_when_every_checkpoint_is_damaged(tmp_path):
    def truncate(path):
        data = (path / "state.pt").read_bytes()
        (path / "state.pt").write_bytes(data[: len(data) // 2])

    message = refused_resume(tmp_path, truncate)
    assert "every checkpoint" in message and "damaged" in message
    assert "step-00000002: " in message and "step-00000004: " in message
    assert "set resume=fresh (they are moved aside" in message and "resume=PATH" in message


def test_falling_back_past_a_damaged_checkpoint_keeps_the_new_ones(tmp_path):
    ToyTrainer(toy_config(tmp_path, max_steps=10, save_every_n_steps=5, keep_last=2)).fit()
    root = tmp_path / "run" / "checkpoints"
    (root / "step-00000010" / "state.pt").write_bytes(b"damaged")
    cfg = toy_config(tmp_path, max_steps=7, save_every_n_steps=5, keep_last=1)
    cfg["resume"] = "auto"
    t = ToyTrainer(cfg)
    t.fit()  # resumes from step 5 and saves step 7 at the end
    assert [p.name for p in list_checkpoints(root)] == ["step-00000007", "step-00000010"]
    again = ToyTrainer(cfg)
    again.fit()  # step 10 is still damaged; step 7 is the newest good one
    assert again.state.step == 7 and CountingSteps.steps_run == 0


# A process that SIGKILLs itself between the two renames of the re-save of step 4
# (run's end: max_steps is a multiple of save_every_n_steps), then trains as toys.main does.
CRASH_IN_RESAVE = f"""
import os, signal, sys
import torch
torch.set_num_threads(1)
sys.path.insert(0, {os.path.dirname(TOYS_PATH)!r})
real, calls = os.replace, []
def replace(src, dst, *args, **kwargs):
    if os.path.basename(dst) == "step-00000004":
        calls.append(dst)
        if len(calls) == 2:  # the second rename into step-00000004: the new copy's
            os.kill(os.getpid(), signal.SIGKILL)
    return real(src, dst, *args, **kwargs)
os.replace = replace
import toys
toys.main()
"""


class CountingSelfSignalling(SelfSignalling):
    steps_run = 0

    def training_step(self, batch):
        type(self).steps_run += 1
        return super().training_step(batch)


def test_a_crash_between_the_renames_of_a_step_saved_again_loses_nothing(tmp_path):
    def cfg(run_dir, resume=None):
        # the final log point and validation change the state after the in-loop save at 4
        c = toy_config(tmp_path, max_steps=4, save_every_n_steps=2, keep_last=1,
                       log_every_n_steps=3, val_every_n_steps=3)
        c["trainer"]["run_dir"] = str(run_dir)
        c["callbacks"] = {"stop": {"_target_": "saferun.stopping.EarlyStopping", "patience": 9}}
        c["resume"] = resume
        return c

    crashed = subprocess.run([sys.executable, "-c", CRASH_IN_RESAVE, json.dumps(cfg(tmp_path / "a"))],
                             capture_output=True, text=True, timeout=300)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    root = tmp_path / "a" / "checkpoints"
    assert [p.name.split(".")[0] for p in list_checkpoints(root)] == ["step-00000004"]
    CountingSelfSignalling.steps_run = 0
    resumed = CountingSelfSignalling(cfg(tmp_path / "a", resume="auto"))
    resumed.fit()
    assert CountingSelfSignalling.steps_run == 0  # resumed at step 4, not retrained from 0
    straight = SelfSignalling(cfg(tmp_path / "b"))
    straight.fit()
    a, b = (load_checkpoint(r / "checkpoints" / "step-00000004") for r in (tmp_path / "a", tmp_path / "b"))
    for state in (a, b):
        del state["config"]["trainer"]["run_dir"], state["config"]["resume"], state["provenance"]
    assert_same_state(a, b)  # the whole state, RNG and callbacks included
    assert_same_state(torch.load(tmp_path / "a" / "model.pt", weights_only=True),
                      torch.load(tmp_path / "b" / "model.pt", weights_only=True))
    assert [p.name for p in list_checkpoints(root)] == ["step-00000004"]


def test_grad_scaler_state_is_saved_and_restored(tmp_path):
    def run(max_steps, resume=None, run_dir="run"):
        cfg = toy_config(tmp_path, max_steps=max_steps, save_every_n_steps=5,
                         run_dir=str(tmp_path / run_dir))
        cfg["resume"] = resume
        t = ScaledOnCpu(cfg)
        t.fit()
        return t

    first = run(5)  # growth_interval=2: the scale doubled twice by step 5
    saved = load_latest(tmp_path / "run" / "checkpoints")[1]["scaler"]
    assert saved == first.scaler.state_dict() and saved["scale"] == 2.0**12
    straight = run(9, run_dir="straight")
    resumed = run(9, resume=str(tmp_path / "run" / "checkpoints" / "step-00000005"))
    assert resumed.scaler.state_dict() == straight.scaler.state_dict()
    assert resumed.scaler.get_scale() == 2.0**14
    resumed_weights, straight_weights = weights(resumed), weights(straight)
    assert all(torch.equal(resumed_weights[k], v) for k, v in straight_weights.items())


def test_files_and_directories_are_fsynced_before_the_checkpoint_appears(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):  # a spy: records which file or directory, then really syncs it
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", os.path.basename(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 7, {"x": torch.ones(2)})
    tmp = next(name for kind, name in events if kind == "fsync" and name.startswith(".tmp-step-"))
    assert events == [("fsync", "state.pt"), ("fsync", "manifest.json"), ("fsync", tmp),
                      ("rename", "step-00000007"), ("fsync", "checkpoints")]


def test_a_failed_save_leaves_the_previous_checkpoints(tmp_path):
    from saferun import Callback

    class BadStateAt4(Callback):
        """Its state cannot be saved safely from step 4 on: that save fails."""

        def __init__(self):
            self.step = 0

        def on_train_step_end(self, view, output):
            self.step = view.step

        def state_dict(self):
            return {"when": Payload("m") if self.step >= 4 else None}

    t = ToyTrainer(toy_config(tmp_path, max_steps=6, save_every_n_steps=2, keep_last=1),
                   callbacks=[BadStateAt4()])
    with pytest.raises(CheckpointError, match="Payload"):
        t.fit()
    root = tmp_path / "run" / "checkpoints"
    assert [p.name for p in list_checkpoints(root)] == ["step-00000002"]
    assert load_latest(root)[1]["loop"]["step"] == 2


@pytest.mark.parametrize("mode", ["min", "max"])
def test_save_best_never_keeps_a_nan_as_the_best(tmp_path, mode):
    from saferun.checkpoint.checkpointer import Checkpointer

    cfg = toy_config(tmp_path, save_best="val/loss", save_best_mode=mode)
    trainer = ToyTrainer(cfg)
    c = Checkpointer(trainer, lambda: pytest.fail("_improves reads no parts"))
    assert not c._improves({"val/loss": float("nan")}, "val/loss")  # a NaN is never the best
    c.best = c._best_record([float("nan"), "step-00000005", 5])  # a NaN best (saved by an older saferun)
    assert c._improves({"val/loss": 0.5}, "val/loss")  # is beaten by any number
    c.best = c._best_record([0.5, "step-00000010", 10])
    assert c._improves({"val/loss": 0.4 if mode == "min" else 0.6}, "val/loss")
    assert not c._improves({"val/loss": float("nan")}, "val/loss")
