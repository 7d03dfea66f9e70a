"""Trainer.test(): test_step over a test set as validation runs (eval mode, inference_mode,
purity guard), reported under test/ in the return value, metrics.jsonl, summary.json and
TensorBoard."""

import json

import pytest
import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader, TensorDataset

from saferun.errors import SaferunError
from toys import TENSORBOARD, ToyTrainer, make_classification, toy_config


def held_out(n=61, seed=1):
    x, y = make_classification(n, seed=seed)
    return TensorDataset(x, y)


def by_hand(model, data, batch_size):
    """The test metrics with a plain eval loop: batch-size-weighted means."""
    model.eval()
    total, n = {"loss": 0.0, "acc": 0.0}, 0
    with torch.no_grad():
        for x, y in DataLoader(data, batch_size=batch_size):
            logits = model(x)
            total["loss"] += F.cross_entropy(logits, y).item() * len(y)
            total["acc"] += (logits.argmax(1) == y).float().mean().item() * len(y)
            n += len(y)
    model.train()
    return {f"test/{k}": v / n for k, v in total.items()}


@pytest.mark.parametrize("as_loader", [False, True])
def test_test_equals_a_hand_written_eval_loop(tmp_path, as_loader):
    # limit_val_batches limits validation, never the test set
    t = ToyTrainer(toy_config(tmp_path, max_steps=6, val_batch_size=16, limit_val_batches=2))
    t.fit()
    data = held_out()
    metrics = t.test(DataLoader(data, batch_size=10) if as_loader else data)
    expected = by_hand(t.model, data, 16)
    assert metrics.keys() == expected.keys()
    for k, v in expected.items():
        assert metrics[k] == pytest.approx(v, rel=1e-6, abs=1e-7), k
    assert t.model.training  # training's mode is back


class Watches(ToyTrainer):
    def test_step(self, batch):
        self.seen.append((any(m.training for m in self.model.modules()),
                          torch.is_inference_mode_enabled(), self.test_loader is not None))
        return super().test_step(batch)


def test_test_step_runs_in_eval_mode_under_inference_mode(tmp_path):
    t = Watches(toy_config(tmp_path, max_steps=2))
    t.seen = []
    t.test(held_out(20))
    assert t.seen == [(False, True, True)]
    assert t.test_loader is None


class Pollutes(ToyTrainer):
    def test_step(self, batch):
        self.model.backbone[1].running_mean.add_(1.0)  # planted: evaluation changes a buffer
        return super().test_step(batch)


def test_a_test_step_that_changes_the_model_is_refused(tmp_path):
    t = Pollutes(toy_config(tmp_path, max_steps=2))
    with pytest.raises(SaferunError, match="running_mean"):
        t.test(held_out(20))


class LogsOnly(ToyTrainer):
    def test_step(self, batch):
        x, y = batch
        logits = self.model(x)
        self.log("err", (logits.argmax(1) != y).float().mean())
        self.log("worst", F.cross_entropy(logits, y, reduction="none").max(), reduce="max")


def test_what_test_step_only_logs_is_reported_everywhere(tmp_path):
    cfg = toy_config(tmp_path, max_steps=4)
    cfg["logger"] = {**TENSORBOARD, "jsonl": {}}
    t = LogsOnly(cfg)
    t.fit()
    data = held_out()
    metrics = t.test(data)
    x, y = data.tensors
    t.model.eval()
    with torch.no_grad():
        logits = t.model(x)
    t.model.train()
    assert metrics["test/err"] == pytest.approx((logits.argmax(1) != y).float().mean().item(), abs=1e-6)
    assert metrics["test/worst"] == pytest.approx(
        F.cross_entropy(logits, y, reduction="none").max().item(), rel=1e-6)
    run = tmp_path / "run"
    line = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert line["kind"] == "test" and line["step"] == 4
    assert {k: line[k] for k in metrics} == metrics
    summary = json.loads((run / "summary.json").read_text())
    assert summary["test"] == metrics and summary["test_at_step"] == 4
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    assert acc.Scalars("test/err")[-1].value == pytest.approx(metrics["test/err"])
    assert acc.Scalars("test/err")[-1].step == 4


def test_test_metrics_outside_fit_stay_in_tensorboard_when_their_file_would_sort_first(tmp_path):
    # TensorBoard reads a directory's event files in name order, and the fit's file begins with
    # a START event that hides every step read before it above its own: a test() writer whose
    # file sorts first (opened in the same second with counter .10 after .9, or planted here by
    # dating the fit's file one second ahead) would have its test/* hidden
    import re
    import time

    cfg = toy_config(tmp_path, max_steps=4)
    cfg["logger"] = {**TENSORBOARD}
    t = LogsOnly(cfg)
    t.fit()
    board = tmp_path / "run" / "tensorboard"
    [fit_file] = [p for p in board.iterdir() if "tfevents" in p.name and not p.name.endswith(".hparams")]
    ahead = re.sub(r"tfevents\.\d+\.", f"tfevents.{int(time.time()) + 1}.", fit_file.name)
    fit_file.rename(board / ahead)
    metrics = t.test(held_out())
    acc = EventAccumulator(str(board))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("test/err")] == [(4, pytest.approx(metrics["test/err"]))]
    assert [e.step for e in acc.Scalars("train/loss")][-1] == 4
    assert sorted(p.name for p in board.iterdir() if not p.name.endswith(".hparams"))[-1] != ahead  # it sorts last


class ThreeSets(ToyTrainer):
    def build_datasets(self):
        train, val = super().build_datasets()
        return train, val, held_out(30)


def test_build_datasets_may_return_a_test_set(tmp_path):
    t = ThreeSets(toy_config(tmp_path, max_steps=2))
    assert t.test() == t.test(held_out(30))


def test_no_test_set_is_refused_with_what_to_do(tmp_path):
    t = ToyTrainer(toy_config(tmp_path, max_steps=2))
    with pytest.raises(SaferunError, match=r"no test set.*trainer.test\(dataset_or_loader\)"):
        t.test()


class FourSets(ToyTrainer):
    def build_datasets(self):
        return (*super().build_datasets(), None, None)


def test_build_datasets_returning_four_sets_is_refused(tmp_path):
    with pytest.raises(SaferunError, match=r"returned tuple of 4.*\(train, val, test\)"):
        FourSets(toy_config(tmp_path, max_steps=2)).setup()
