"""Learning-rate schedules in the loop: the logged rates and metric-driven schedulers."""

import pytest
import torch

import saferun
from toys import ToyTrainer, toy_config, weights


class Logged(saferun.Callback):
    """Every on_log's metrics, by step."""

    def __init__(self):
        self.at = {}

    def on_log(self, view, metrics):
        self.at[view.step] = dict(metrics)


class ThreeGroups(ToyTrainer):
    """The first layer, the BatchNorm (no name) and the head (named) at different rates."""

    def build_optimizer(self, params):
        m = self.model
        return torch.optim.SGD([{"params": m.backbone[0].parameters(), "lr": 0.1},
                                {"params": m.backbone[1].parameters(), "lr": 0.02},
                                {"params": m.head.parameters(), "lr": 0.004, "name": "head"}])


def test_the_logged_rate_at_each_step_is_the_one_it_used_for_every_group(tmp_path):
    cfg = toy_config(tmp_path, max_steps=4, log_every_n_steps=1)
    cfg["sched"] = {"_target_": "torch.optim.lr_scheduler.StepLR", "step_size": 1, "gamma": 0.5}
    log = Logged()
    ThreeGroups(cfg, callbacks=[log]).fit()
    for step in (1, 2, 3, 4):
        factor = 0.5 ** (step - 1)  # step 1 used the initial rates
        rates = {k: v for k, v in log.at[step].items() if k.startswith("train/lr")}
        assert rates == {"train/lr": 0.1 * factor, "train/lr/group1": 0.02 * factor,
                         "train/lr/head": 0.004 * factor}


def test_without_a_scheduler_the_rate_is_read_at_log_points_only(tmp_path):
    log = Logged()
    ToyTrainer(toy_config(tmp_path, max_steps=4, log_every_n_steps=2), callbacks=[log]).fit()
    assert [log.at[s]["train/lr"] for s in (2, 4)] == [0.05, 0.05]
    assert not any(k.startswith("train/lr/") for k in log.at[4])  # one group: train/lr alone


class ScoredValidation(ToyTrainer):
    """Validation loss scripted per step: improves at 4, then worse at 6 and 8."""

    def validation_step(self, batch):
        return {"loss": torch.tensor({2: 1.0, 4: 0.9, 6: 0.95, 8: 0.97}[self.state.step])}


def plateau_config(tmp_path, **sched):
    cfg = toy_config(tmp_path, max_steps=8, log_every_n_steps=1, val_every_n_steps=2,
                     save_every_n_steps=4, sched_metric="val/loss")
    cfg["sched"] = {"_target_": "torch.optim.lr_scheduler.ReduceLROnPlateau", "mode": "min",
                    "patience": 0, "factor": 0.5, **sched}
    return cfg


def test_a_plateau_scheduler_is_stepped_with_the_validation_metric(tmp_path):
    log = Logged()
    t = ScoredValidation(plateau_config(tmp_path), callbacks=[log])
    t.fit()
    # no improvement at step 6: halved after that validation, and again after step 8's
    assert [log.at[s]["train/lr"] for s in range(1, 9)] == [0.05] * 6 + [0.025] * 2
    assert t.optimizer.param_groups[0]["lr"] == 0.0125
    assert t.scheduler.best == float(torch.tensor(0.9)) and t.scheduler.last_epoch == 4


def test_a_plateau_scheduler_resumes_exactly(tmp_path):
    straight = ScoredValidation(plateau_config(tmp_path / "a"))
    straight.fit()
    cfg = plateau_config(tmp_path / "b")
    cfg["trainer"]["max_steps"] = 4
    ScoredValidation(cfg).fit()
    cfg = plateau_config(tmp_path / "b")
    cfg["resume"] = "auto"
    resumed = ScoredValidation(cfg)
    resumed.fit()
    assert resumed.scheduler.state_dict() == straight.scheduler.state_dict()
    a, b = weights(straight), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("sched, metric, validation, words", [
    ({"_target_": "torch.optim.lr_scheduler.ReduceLROnPlateau"}, None, True,
     "ReduceLROnPlateau is stepped with a validation metric.*trainer.sched_metric"),
    ({"_target_": "torch.optim.lr_scheduler.StepLR", "step_size": 2}, "val/loss", True,
     "trainer.sched_metric='val/loss' is set, but the scheduler \\(StepLR\\) is stepped once"),
    (None, "val/loss", True, "trainer.sched_metric='val/loss' is set, but the scheduler \\(none\\)"),
    ({"_target_": "torch.optim.lr_scheduler.ReduceLROnPlateau"}, "val/loss", False,
     "needs validation data"),
])
def test_metric_scheduling_that_cannot_work_is_refused_at_setup(tmp_path, sched, metric,
                                                                validation, words):
    class Task(ToyTrainer):
        def build_datasets(self):
            train, val = super().build_datasets()
            return train, val if validation else None

    cfg = toy_config(tmp_path, sched_metric=metric)
    cfg["sched"] = sched
    t = Task(cfg)
    with pytest.raises(saferun.ConfigError, match=words):
        t.setup()
    assert t.state.step == 0


def test_a_sched_metric_validation_does_not_report_is_named(tmp_path):
    cfg = plateau_config(tmp_path)
    cfg["trainer"]["sched_metric"] = "val/acc"
    with pytest.raises(saferun.ConfigError, match="sched_metric='val/acc', but validation "
                                                  "reports only val/loss"):
        ScoredValidation(cfg).fit()


# ---------------------------------------------------------------- a second fit()

def fit_state(t):
    """Parameters and buffers, optimizer and scheduler state, the loop's counters and the
    logged curve (metrics.jsonl: each step's train/ and val/ values, perf/ timings aside)."""
    import json
    from pathlib import Path

    curve = [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/") and k != "time"}
             for line in (Path(t.state.run_dir) / "metrics.jsonl").read_text().splitlines()]
    return (weights(t), str(t.optimizer.state_dict()), str(t.scheduler.state_dict()),
            (t.state.step, t.state.epoch, t.state.batches_in_epoch, t.state.samples_seen), curve)


def assert_same_fit(a, b):
    assert a[0].keys() == b[0].keys() and [k for k in a[0] if not torch.equal(a[0][k], b[0][k])] == []
    assert a[1:4] == b[1:4]
    assert a[4] == b[4]


def sched_config(run_dir, max_steps, sched):
    cfg = toy_config(run_dir, max_steps=max_steps, log_every_n_steps=1, val_every_n_steps=4)
    cfg["logger"] = {"jsonl": {"_target_": "saferun.loggers.MetricsJsonl"}}
    cfg["sched"] = sched
    return cfg


# a schedule whose rates do not depend on the run's length: a second fit is one longer run
@pytest.mark.parametrize("sched", [
    {"_target_": "torch.optim.lr_scheduler.StepLR", "step_size": 3, "gamma": 0.5},
    {"_target_": "saferun.schedules.warmup_cosine", "warmup_steps": 2, "total_steps": 30},
])
def test_a_second_fit_with_a_length_independent_schedule_equals_one_longer_run(tmp_path, sched):
    straight = ToyTrainer(sched_config(tmp_path / "a", 12, sched))
    straight.fit()
    twice = ToyTrainer(sched_config(tmp_path / "b", 4, sched))
    twice.fit()
    twice.cfg.trainer.max_steps = 12
    twice.fit()
    assert_same_fit(fit_state(twice), fit_state(straight))


# sized for the run's length (conf/sched/cosine.yaml): the steps already taken used the
# shorter schedule's rates, so no second fit can equal one longer run; refused as a resume
# with the changed length is, before any step
@pytest.mark.parametrize("sched, key", [
    ({"_target_": "saferun.schedules.warmup_cosine", "warmup_steps": 1,
      "total_steps": "${trainer.max_steps}"}, "sched.total_steps: 4 -> 12"),
    ({"_target_": "torch.optim.lr_scheduler.OneCycleLR", "max_lr": 0.1,
      "total_steps": "${trainer.max_steps}"}, "sched.total_steps: 4 -> 12"),
])
def test_a_second_fit_with_a_schedule_sized_for_the_first_is_refused_as_a_resume_is(
        tmp_path, sched, key):
    t = ToyTrainer(sched_config(tmp_path, 4, sched))
    t.fit()
    before = fit_state(t)
    t.cfg.trainer.max_steps = 12
    with pytest.raises(saferun.ConfigError) as refused:
        t.fit()
    said = str(refused.value)
    assert "second fit()" in said and key in said and "trainer.max_steps=12" in said
    assert "force_resume=true" in said and "step-00000004" in said
    assert_same_fit(fit_state(t), before)  # nothing trained, nothing logged
    # the same change through the checkpoint is refused by the same check
    cfg = sched_config(tmp_path, 12, sched)
    cfg["resume"] = "auto"
    with pytest.raises(saferun.ConfigError, match=key):
        ToyTrainer(cfg).fit()


def test_a_schedule_with_fewer_steps_than_the_run_is_refused_before_the_first_step(tmp_path):
    # OneCycleLR with a literal total_steps: torch's bare ValueError at step 5 otherwise, in one
    # fit of 12 steps as in a second fit raised to 12
    sched = {"_target_": "torch.optim.lr_scheduler.OneCycleLR", "max_lr": 0.1, "total_steps": 4}
    words = (r"sched \(OneCycleLR\) has total_steps=4, fewer than the run's 12 steps.*"
             r"sched.total_steps: \$\{trainer.max_steps\}")
    with pytest.raises(saferun.ConfigError, match=words):
        ToyTrainer(sched_config(tmp_path / "a", 12, sched)).fit()
    assert not (tmp_path / "a" / "run" / "metrics.jsonl").exists()  # nothing trained
    t = ToyTrainer(sched_config(tmp_path / "b", 4, sched))
    t.fit()
    t.cfg.trainer.max_steps = 12
    with pytest.raises(saferun.ConfigError, match=words):
        t.fit()
    assert t.state.step == 4
