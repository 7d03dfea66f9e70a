"""model_best.pt (trainer.save_best): written at each new best, kept exactly across a resume,
loaded by Trainer.from_run and saferun.load_model; EarlyStopping(restore_best=True)."""

import json
from pathlib import Path

import pytest
import torch

import saferun
from saferun.checkpoint import load_checkpoint
from saferun.checkpoint.weights import Best
from saferun.errors import ConfigError, SaferunError
from saferun.stopping import EarlyStopping
from test_checkpoint import ScoreAt
from toys import ToyTrainer, toy_config



class Scored(ScoreAt):
    """ScoreAt's scripted score (lower is better: 5, 3, 4, 6 at steps 4, 8, 12, 16; the best at
    step 8) beside ToyTrainer's loss and accuracy."""

    def validation_step(self, batch):
        return {**ToyTrainer.validation_step(self, batch), **super().validation_step(batch)}


def config(tmp_path, **trainer):
    base = dict(max_steps=16, val_every_n_steps=4, save_every_n_steps=4, keep_last=10,
                save_best="val/score", save_best_mode="min")
    return toy_config(tmp_path, **{**base, **trainer})


def assert_same(a, b):
    """Two state dicts equal bitwise, key for key (parameters and buffers)."""
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def load(path):
    return torch.load(path, weights_only=True)


def checkpoint_model(run, step):
    return load_checkpoint(run / "checkpoints" / f"step-{step:08d}")["model"]


def test_model_best_holds_the_weights_of_the_best_validation(tmp_path):
    t = Scored(config(tmp_path, ema={"decay": 0.5}))
    t.fit()
    run = tmp_path / "run"
    assert_same(load(run / "model_best.pt"), checkpoint_model(run, 8))  # not 16, not 4
    assert_same(load(run / "model.pt"), checkpoint_model(run, 16))
    ema = load_checkpoint(run / "checkpoints" / "step-00000008")["ema"]
    assert_same(load(run / "model_ema_best.pt"),
                {k[len("module."):]: v for k, v in ema.items() if k.startswith("module.")})
    assert t.best == Best("val/score", 3.0, 8, str(run / "model_best.pt"),
                          str(run / "checkpoints" / "step-00000008"))
    assert json.loads((run / "summary.json").read_text())["best"]["step"] == 8


def test_no_save_best_no_model_best_and_no_best(tmp_path):
    t = Scored(config(tmp_path, save_best=None, max_steps=4))
    t.fit()
    assert t.best is None and not (tmp_path / "run" / "model_best.pt").exists()


def test_a_resumed_run_keeps_the_best_and_does_not_overwrite_model_best(tmp_path):
    cfg = config(tmp_path, save_every_n_steps=None, keep_last=1)
    crashing = Scored(cfg)
    crashing.crash_at = 9  # after the best (step 8), before any other checkpoint
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashing.fit()
    run = tmp_path / "run"
    best_before = load(run / "model_best.pt")
    assert_same(best_before, checkpoint_model(run, 8))
    cfg["resume"] = "auto"
    resumed = Scored(cfg)
    resumed.fit()  # step 12 scores 4.0: a new best for a run that forgot step 8's 3.0
    assert_same(load(run / "model_best.pt"), best_before)
    assert resumed.best.step == 8 and resumed.best.value == 3.0


def test_a_crash_between_the_best_checkpoint_and_model_best_is_repaired_on_resume(tmp_path):
    cfg = config(tmp_path, save_every_n_steps=None, keep_last=1, max_steps=8)
    Scored(cfg).fit()
    run = tmp_path / "run"
    right = load(run / "model_best.pt")
    # planted: model_best.pt still the previous best's (step 4), as a kill right after the
    # step-8 checkpoint leaves it
    torch.save({k: v + 1 if v.is_floating_point() else v for k, v in right.items()},
               run / "model_best.pt")
    cfg["trainer"]["max_steps"] = 12
    cfg["resume"] = "auto"
    Scored(cfg).fit()
    assert_same(load(run / "model_best.pt"), right)


# ---------------------------------------------------------------- from_run, load_model


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished run with save_best and a model node (so load_model can rebuild it)."""
    tmp = tmp_path_factory.mktemp("best")
    cfg = config(tmp)
    cfg["model"] = {"_target_": "toys.Net"}
    cfg["logger"] = {"jsonl": {}}
    Scored(cfg).fit()
    return tmp / "run"


def files_of(run):
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in run.rglob("*") if p.is_file()}


def test_from_run_best_loads_model_best_bitwise_and_never_writes_the_old_run(finished, tmp_path):
    before = files_of(finished)
    t = Scored.from_run(str(finished), "best", out_dir=str(tmp_path / "eval"))
    assert type(t) is Scored
    assert_same(t.model.state_dict(), load(finished / "model_best.pt"))
    t.validate()
    metrics = t.test(t.val_loader.dataset)
    assert set(metrics) == {"test/loss", "test/acc", "test/score"}
    assert files_of(finished) == before  # no truncated metrics.jsonl, no new checkpoint
    line = json.loads((tmp_path / "eval" / "metrics.jsonl").read_text().splitlines()[-1])
    assert line["kind"] == "test" and line["step"] == 8  # the step the weights are from


@pytest.mark.parametrize("checkpoint", ["last", "step"])
def test_from_run_last_and_a_checkpoint_directory(finished, tmp_path, checkpoint):
    if checkpoint == "last":
        t, expected = Scored.from_run(str(finished), "last", out_dir=str(tmp_path)), \
            load(finished / "model.pt")
    else:
        path = finished / "checkpoints" / "step-00000012"
        t, expected = Scored.from_run(str(finished), str(path), out_dir=str(tmp_path)), \
            checkpoint_model(finished, 12)
    assert_same(t.model.state_dict(), expected)


def test_from_run_without_out_dir_gets_a_new_run_directory(finished, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    t = Scored.from_run(str(finished))
    assert Path(t.state.run_dir).parent == Path("runs") and not Path(t.state.run_dir).exists()


def test_load_model_rebuilds_the_model_node_with_the_weights_in_eval_mode(finished):
    model = saferun.load_model(str(finished), "best")
    assert not any(m.training for m in model.modules())
    assert_same(model.state_dict(), load(finished / "model_best.pt"))
    assert_same(saferun.load_model(finished, "last").state_dict(), load(finished / "model.pt"))


def test_refusals_name_what_is_wrong(finished, tmp_path):
    with pytest.raises(SaferunError, match="does not exist"):
        saferun.load_model(str(tmp_path / "nothere"))
    with pytest.raises(SaferunError, match="'latest' does not exist: name best.*last"):
        Scored.from_run(str(finished), "latest")
    with pytest.raises(SaferunError, match="config.yaml is not a readable weights file"):
        saferun.load_model(str(finished), str(finished / "config.yaml"))
    no_best = tmp_path / "nobest"
    Scored(config(tmp_path, save_best=None, max_steps=4, run_dir=str(no_best))).fit()
    with pytest.raises(SaferunError, match="did not set trainer.save_best.*trainer.save_best="):
        Scored.from_run(str(no_best), "best")
    with pytest.raises(SaferunError, match="no model node.*from_run"):
        saferun.load_model(str(no_best), "last")
    with pytest.raises(SaferunError, match="no config.yaml"):
        saferun.load_model(str(finished / "checkpoints"))


def test_weights_that_do_not_fit_name_the_keys(finished, tmp_path):
    run = tmp_path / "copy"
    run.mkdir()
    (run / "config.yaml").write_text((finished / "config.yaml").read_text())
    planted = load(finished / "model.pt")
    planted["extra.weight"] = planted.pop("head.weight")
    planted["backbone.0.bias"] = torch.zeros(3)
    torch.save(planted, run / "model.pt")  # named as a file (a run's model.pt must verify)
    with pytest.raises(SaferunError) as e:
        saferun.load_model(str(run), str(run / "model.pt"))
    said = str(e.value)
    assert "missing from the weights: head.weight" in said and "not in the model: extra.weight" in said
    assert "backbone.0.bias (3,) vs the model's (16,)" in said
    with pytest.raises(SaferunError, match="head.weight"):
        Scored.from_run(str(run), str(run / "model.pt"), out_dir=str(tmp_path / "o"))


# ---------------------------------------------------------------- EarlyStopping(restore_best)


def test_restore_best_puts_the_best_weights_back_and_keeps_the_files(tmp_path):
    stopper = EarlyStopping(monitor="val/score", mode="min", patience=2, restore_best=True)
    t = Scored(config(tmp_path, ema={"decay": 0.5}), callbacks=[stopper])
    final = t.fit()
    run = tmp_path / "run"
    assert t.state.step == 16 and final["val/score"] == 6.0  # fit returns the final metrics
    step8 = load_checkpoint(run / "checkpoints" / "step-00000008")
    assert_same(t.model.state_dict(), step8["model"])
    assert_same(t.ema.state_dict(), step8["ema"])
    assert_same(load(run / "model.pt"), checkpoint_model(run, 16))  # the files stay
    assert_same(load(run / "model_best.pt"), step8["model"])
    t.cfg.trainer.max_steps = 20
    with pytest.raises(SaferunError, match="restore_best.*mix"):
        t.fit()


def test_restore_best_needs_save_best_on_the_same_metric(tmp_path):
    stopper = EarlyStopping(monitor="val/loss", mode="min", restore_best=True)
    with pytest.raises(ConfigError, match="trainer.save_best=val/loss"):
        Scored(config(tmp_path), callbacks=[stopper]).fit()


def test_without_restore_best_the_model_keeps_its_final_weights(tmp_path):
    stopper = EarlyStopping(monitor="val/score", mode="min", patience=2)
    t = Scored(config(tmp_path), callbacks=[stopper])
    t.fit()
    assert_same(t.model.state_dict(), checkpoint_model(tmp_path / "run", 16))


def test_an_evaluating_trainer_resumed_from_a_run_knows_its_best(finished):
    """resume=auto set up for evaluation (validate()/test(), no fit) loads the best record
    too: Trainer.best was None there although the run has one."""
    cfg = config(finished.parent)
    cfg.update(model={"_target_": "toys.Net"}, logger={}, resume="auto")
    t = Scored(cfg)
    t.setup()
    assert t.best is not None and (t.best.step, t.best.value) == (8, 3.0)


def test_test_never_writes_into_a_run_it_did_not_evaluate(finished, tmp_path):
    """from_run's out_dir may be neither the run read nor another run's directory; a Trainer
    over a finished run with resume unset is refused by test() (it would write the numbers of
    the model as built into that run's summary), where validate() only warns."""
    before = files_of(finished)
    for out_dir in (finished, finished / "." ):
        with pytest.raises(SaferunError, match="is the run directory being read"):
            Scored.from_run(str(finished), "best", out_dir=str(out_dir))
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text("")
    with pytest.raises(SaferunError, match="holds another run's metrics.jsonl"):
        Scored.from_run(str(finished), "best", out_dir=str(other))
    cfg = config(finished.parent)
    cfg.update(model={"_target_": "toys.Net"}, logger={"jsonl": {}})
    plain = Scored(cfg)
    with pytest.raises(SaferunError, match="test\\(\\): resume is unset"):
        plain.test(plain.build_datasets()[1])
    assert files_of(finished) == before


def test_a_resume_that_changes_save_best_tracks_the_best_anew(tmp_path, caplog):
    """The old metric's best value must not be compared with the new metric's values."""
    cfg = config(tmp_path, save_every_n_steps=None, keep_last=1)
    crashing = Scored(cfg)
    crashing.crash_at = 9  # after the best val/score (step 8)
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashing.fit()
    cfg["resume"] = "auto"
    cfg["trainer"].update(save_best="val/acc", save_best_mode="max")
    with caplog.at_level("WARNING", logger="saferun"):
        resumed = Scored(cfg)
        resumed.fit()
    assert any("save_best changed on resume" in r.getMessage() for r in caplog.records)
    assert resumed.best.metric == "val/acc" and resumed.best.step >= 12  # not step 8's val/score
    assert 0.0 <= resumed.best.value <= 1.0  # an accuracy, not the score 3.0


# ---------------------------------------------------------------- the weights files' digests


def copy_of(run, tmp_path):
    import shutil

    return Path(shutil.copytree(run, tmp_path / "copy"))


def flip_a_bit(path):
    """One bit of the last weight's bytes flipped: still a loadable file of other weights."""
    data = bytearray(path.read_bytes())
    data[len(data) - 1000] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name, checkpoint", [("model_best.pt", "best"), ("model.pt", "last"),
                                              ("model_ema_best.pt", "best")])
def test_a_flipped_bit_in_a_weights_file_is_refused_by_load_model_and_from_run(
        finished, tmp_path, name, checkpoint):
    run = copy_of(finished, tmp_path)
    if name.startswith("model_ema"):
        cfg = config(tmp_path, ema={"decay": 0.5}, max_steps=8, run_dir=str(tmp_path / "ema"))
        Scored(cfg).fit()
        run = tmp_path / "ema"
    else:
        saferun.load_model(str(run), checkpoint)  # unflipped: verified and loaded
    flip_a_bit(run / name)
    with pytest.raises(saferun.SaferunError, match=rf"{name} does not match the digest recorded "
                                                   rf"for it in summary.json"):
        Scored.from_run(str(run), checkpoint, out_dir=str(tmp_path / "eval"))
    if not name.startswith("model_ema"):
        with pytest.raises(saferun.SaferunError, match="corrupted or replaced"):
            saferun.load_model(str(run), checkpoint)


def test_a_missing_model_best_is_reported_missing(finished, tmp_path):
    run = copy_of(finished, tmp_path)
    (run / "model_best.pt").unlink()
    with pytest.raises(SaferunError) as e:
        Scored.from_run(str(run), "best", out_dir=str(tmp_path / "eval"))
    said = str(e.value)
    assert "has no model_best.pt, although its summary.json records a best (val/score 3.0 at " \
           "step 8): the file was moved or deleted" in said
    assert "no validation has reported" not in said


KILLED = """
import os, signal, sys
from pathlib import Path

sys.path.insert(0, {tests!r})
from test_best_model import Scored, config

real, count = os.replace, [0]


def replace(src, dst, *args, **kwargs):  # a real SIGKILL right after the K-th such write
    real(src, dst, *args, **kwargs)
    if os.path.basename(dst) in ("model_best.pt", "summary.json"):
        count[0] += 1
        if count[0] == {k}:
            os.kill(os.getpid(), signal.SIGKILL)


os.replace = replace
Scored(config(Path({tmp!r}), save_every_n_steps=None, max_steps=8)).fit()
"""


# the k-th write of model_best.pt or summary.json: bests at steps 4 and 8, then model.pt's record
@pytest.mark.parametrize("k", [pytest.param(k, marks=[] if k in (3, 5) else pytest.mark.slow)
                               for k in range(1, 8)])
def test_after_a_kill_model_best_and_its_recorded_step_agree(tmp_path, k):
    import subprocess
    import sys

    script = KILLED.format(tests=str(Path(__file__).parent.parent), k=k, tmp=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parent,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr  # killed there
    run = tmp_path / "run"
    if not (run / "model_best.pt").exists():  # killed before the first best's file
        with pytest.raises(SaferunError, match="no model_best.pt"):
            Scored.from_run(str(run), "best", out_dir=str(tmp_path / "eval"))
        return
    t = Scored.from_run(str(run), "best", out_dir=str(tmp_path / "eval"))
    # the weights are those of the step from_run (and summary.json's record it read) names
    assert t.state.step in (4, 8)
    assert_same(t.model.state_dict(), checkpoint_model(run, t.state.step))
    metrics = t.test(t.val_loader.dataset)
    tested = json.loads((tmp_path / "eval" / "summary.json").read_text())["tested"]
    assert tested["step"] == t.state.step and metrics


# ---------------------------------------------------------------- what an evaluation tested


@pytest.mark.parametrize("checkpoint", ["best", "last", "step"])
def test_a_test_records_the_run_the_weights_file_its_step_epoch_and_sha256(
        finished, tmp_path, checkpoint, caplog):
    import hashlib
    import logging

    if checkpoint == "step":
        named = finished / "checkpoints" / "step-00000012"
        file, digest = str(named), json.loads((named / "manifest.json").read_text())[
            "files"]["state.pt"]["sha256"]
        step = 12
    else:
        file = str(finished / ("model_best.pt" if checkpoint == "best" else "model.pt"))
        digest = hashlib.sha256(Path(file).read_bytes()).hexdigest()
        step = 8 if checkpoint == "best" else 16
    epoch = load_checkpoint(finished / "checkpoints" / f"step-{step:08d}")["loop"]["epoch"]
    t = Scored.from_run(str(finished), file if checkpoint == "step" else checkpoint,
                        out_dir=str(tmp_path / "eval"))
    with caplog.at_level(logging.INFO, logger="saferun"):
        t.test(t.val_loader.dataset)
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["tested"] == {"run": str(finished.resolve()), "checkpoint": file,
                                 "step": step, "epoch": epoch, "sha256": digest}
    assert f"{file}, step {step}, epoch {epoch}, sha256 {digest}" in caplog.text
    line = json.loads((tmp_path / "eval" / "metrics.jsonl").read_text().splitlines()[-1])
    assert (line["kind"], line["step"], line["epoch"]) == ("test", step, epoch)
    if checkpoint == "last":
        assert epoch == 1  # (the log said epoch 0)
