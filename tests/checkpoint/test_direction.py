"""Which direction of a metric is better: given, or inferred from a well-known name (val/acc:
higher, val/loss: lower), said once in the log, one rule for trainer.save_best, EarlyStopping
and a sweep's objective; a name that says none is refused, naming the setting to add."""

import json
import logging

import pytest
import torch

from saferun.checkpoint import load_checkpoint
from saferun.config import load_config
from saferun.direction import infer_mode
from saferun.errors import ConfigError
from saferun.stopping import EarlyStopping
from saferun.sweep.objective import Objective, objective_of
from saferun.sweep.summary import sweep_summary
from test_checkpoint import ScoreAt
from toys import ToyTrainer, toy_config


class Accuracy(ScoreAt):
    """val/acc scripted per step (higher is better), beside ToyTrainer's loss; ScoreAt's
    crash_at."""

    acc = {4: 0.2, 8: 0.7, 12: 0.5, 16: 0.1, 20: 0.3}  # the best (highest) at 8, the lowest at 16

    def validation_step(self, batch):
        return {"loss": ToyTrainer.validation_step(self, batch)["loss"],
                "acc": torch.tensor(self.acc[self.state.step])}


def config(tmp_path, **trainer):
    base = dict(max_steps=16, val_every_n_steps=4, save_every_n_steps=4, keep_last=10,
                save_best="val/acc")
    return toy_config(tmp_path, **{**base, **trainer})


def same(a, b):
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def files_of(run):
    """Each file and its size and time, but the run directory's lock (taken, then released)."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in run.rglob("*")
            if p.is_file() and p.name != ".saferun.lock"}


@pytest.mark.parametrize("name, mode", [
    ("val/loss", "min"), ("val/loss_ema", "min"), ("val_ema/loss", "min"), ("train/loss", "min"),
    ("val/error_rate", "min"), ("val/top1_err", "min"), ("val/mse", "min"), ("val/rmse", "min"),
    ("val/mae", "min"), ("val/mape", "min"), ("val/perplexity", "min"), ("val/nll", "min"),
    ("val/acc", "max"), ("val/top1_acc", "max"), ("val/accuracy", "max"), ("val_ema/acc", "max"),
    ("val/f1", "max"), ("val/f1_macro", "max"), ("val/auc", "max"), ("val/roc_auc", "max"),
    ("val/r2", "max"), ("val/precision", "max"), ("val/recall", "max"), ("val/bleu", "max"),
    ("val/bleu4", "max"), ("val/map", "max"), ("val/mAP50", "max"), ("val/map@50", "max"),
    # no direction: unknown, both ways, or a component that turns or blurs it
    ("val/score", None), ("val/reward", None), ("val/lossy", None), ("val/accumulated", None),
    ("val/acc_loss", None), ("val/neg_loss", None), ("val/acc_std", None), ("val/top1", None),
])
def test_the_direction_a_name_says(name, mode):
    assert (infer_mode(name) or (None,))[0] == mode


# ---------------------------------------------------------------- trainer.save_best


def test_save_best_of_an_accuracy_keeps_the_highest_and_says_so_once(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="saferun"):
        t = Accuracy(config(tmp_path))
        t.fit()
        t.cfg.trainer.max_steps = 20
        t.fit()  # a second fit: not said again
    run = tmp_path / "run"
    best = load_checkpoint(run / "checkpoints" / "step-00000008")["model"]
    assert same(torch.load(run / "model_best.pt", weights_only=True), best)  # not step 16's
    assert (t.best.step, t.best.value) == (8, pytest.approx(0.7))
    said = [r.getMessage() for r in caplog.records if "inferred" in r.getMessage()]
    assert said == ["trainer.save_best=val/acc: higher is better (inferred from 'acc' in the name;"
                    " trainer.save_best_mode=min says otherwise)."]
    assert json.loads((run / "summary.json").read_text())["best"]["step"] == 8


def test_a_given_mode_wins_over_the_name(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="saferun"):
        t = Accuracy(config(tmp_path, save_best_mode="min"))
        t.fit()
    assert (t.best.step, t.best.value) == (16, pytest.approx(0.1))
    assert "inferred" not in caplog.text


def test_a_name_without_a_direction_is_refused_naming_the_setting(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer.save_best=val/score: .* Say it: "
                                          r"trainer.save_best_mode=max .* or trainer.save_best_mode=min"):
        load_config(config(tmp_path, save_best="val/score"))
    with pytest.raises(ConfigError, match=r'EarlyStopping\(mode="max"\) \(higher is better\) or '
                                          r'EarlyStopping\(mode="min"\)'):
        EarlyStopping(monitor="val/score")
    with pytest.raises(ConfigError, match=r"sweep.metric=val/score: .* sweep.mode=max"):
        objective_of("val/score", None, None, None)
    with pytest.raises(ConfigError, match="trainer.save_best_mode=up: the mode must be min or max"):
        load_config(config(tmp_path, save_best_mode="up"))


@pytest.mark.parametrize("first", ["max", None])
def test_a_resume_keeps_the_best_when_the_mode_was_given_then_inferred(tmp_path, first):
    """The first run said save_best_mode=max, or left it to the name; the resumed command
    leaves it off (inferred max): the best continues as in the uninterrupted run."""
    reference = Accuracy(config(tmp_path / "ref", save_best_mode="max"))
    reference.fit()
    crashing = Accuracy(config(tmp_path, save_best_mode=first, save_every_n_steps=None,
                               keep_last=1))
    crashing.crash_at = 13  # after step 12's validation: the best checkpoint (8) and 12's
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashing.fit()
    resumed = Accuracy({**config(tmp_path, save_every_n_steps=None, keep_last=1), "resume": "auto"})
    resumed.fit()
    assert (resumed.best.step, resumed.best.value) == (reference.best.step, reference.best.value)
    assert same(torch.load(tmp_path / "run" / "model_best.pt", weights_only=True),
                torch.load(tmp_path / "ref" / "run" / "model_best.pt", weights_only=True))


def test_a_resume_that_would_infer_another_mode_than_the_checkpoints_is_refused(tmp_path):
    """The first run kept the lowest val/acc on purpose (save_best_mode=min); a resumed command
    that leaves the setting off would flip the best silently: refused, nothing changed."""
    crashing = Accuracy(config(tmp_path, save_best_mode="min", save_every_n_steps=None,
                               keep_last=1))
    crashing.crash_at = 9
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashing.fit()
    run = tmp_path / "run"
    before = files_of(run)
    resumed = Accuracy({**config(tmp_path, save_every_n_steps=None, keep_last=1), "resume": "auto"})
    with pytest.raises(ConfigError, match="kept with trainer.save_best_mode=min, and this run "
                                          "infers max.*Set trainer.save_best_mode=min to continue"):
        resumed.fit()
    assert files_of(run) == before


# ---------------------------------------------------------------- EarlyStopping


def test_early_stopping_on_an_accuracy_goes_on_while_it_rises(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="saferun"):
        t = Accuracy(config(tmp_path, save_best=None),
                     callbacks=[EarlyStopping(monitor="val/acc", patience=1)])
        t.acc = {4: 0.1, 8: 0.2, 12: 0.3, 16: 0.4}
        t.fit()
    assert t.state.step == 16
    assert [r.getMessage() for r in caplog.records if "inferred" in r.getMessage()] == [
        "EarlyStopping(monitor='val/acc')=val/acc: higher is better (inferred from 'acc' in the "
        "name; EarlyStopping(mode=\"min\") says otherwise)."]


def test_early_stopping_refuses_a_checkpointed_best_of_the_other_mode():
    before = EarlyStopping(monitor="val/acc", mode="min")
    before.best = 0.2
    with pytest.raises(ConfigError, match='tracked with mode=.min., this run uses mode=.max.. '
                                          'Pass EarlyStopping\\(mode="min"\\)'):
        EarlyStopping(monitor="val/acc").load_state_dict(before.state_dict())
    same_mode = EarlyStopping(monitor="val/acc")
    same_mode.load_state_dict({"best": 0.2, "bad_validations": 1})  # an earlier version's state
    assert (same_mode.best, same_mode.bad_validations) == (0.2, 1)


@pytest.mark.parametrize("stopper, best_mode, fix", [
    (dict(mode="min"), None, 'Set EarlyStopping\\(mode="max"\\)\\.$'),  # the stopper is wrong
    ({}, "min", "Set trainer.save_best_mode=max\\.$"),  # save_best is wrong
])
def test_restore_best_names_the_fix_on_the_side_that_is_wrong(tmp_path, stopper, best_mode, fix):
    cb = EarlyStopping(monitor="val/acc", restore_best=True, **stopper)
    with pytest.raises(ConfigError, match=fix):
        Accuracy(config(tmp_path, save_best_mode=best_mode), callbacks=[cb]).fit()


def test_restore_best_with_an_inferred_direction_on_both_sides_restores_the_highest(tmp_path):
    cb = EarlyStopping(monitor="val/acc", patience=10, restore_best=True)
    t = Accuracy(config(tmp_path), callbacks=[cb])
    t.fit()
    step8 = load_checkpoint(tmp_path / "run" / "checkpoints" / "step-00000008")["model"]
    assert same(t.model.state_dict(), step8)


# ---------------------------------------------------------------- a sweep's objective


def test_a_sweep_on_save_best_val_r2_stars_the_highest_job(tmp_path):
    trainer = load_config({"trainer": {"save_best": "val/r2"}}).trainer
    objective = objective_of(None, None, trainer.save_best, trainer.save_best_mode)
    assert objective == Objective("val/r2", "max")
    for job, r2 in enumerate((0.1, 0.6, 0.3)):
        run = tmp_path / str(job)
        run.mkdir()
        (run / "metrics.jsonl").write_text(json.dumps({"kind": "val", "step": 10, "val/r2": r2}) + "\n")
        (run / "summary.json").write_text(json.dumps({
            "run_dir": str(run), "overrides": [f"optim.lr={job}"], "step": 10,
            "metrics": {"val/r2": r2}, "objective": objective.result(str(run), {"val/r2": r2}, 10)}))
    table = sweep_summary(tmp_path)
    [starred] = [line for line in table.splitlines() if line.startswith("*")]
    assert starred.split()[1:4] == ["1", "0.6", "10"] and starred.endswith("optim.lr=1")
