"""Stateful validation metrics (torchmetrics): reset before each validation, computed over the
whole pass, reported as val/<name> with no host sync per batch; mistakes named."""

import pytest
import torch
import torch.nn.functional as F
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

from saferun.errors import SaferunError
from saferun.guards.syncs import HostSyncCounter
from toys import METRICS, ToyTrainer, toy_config


def metric_config(tmp_path, **kw):
    cfg = toy_config(tmp_path, **{"max_steps": 20, "log_every_n_steps": 10,
                                  "val_every_n_steps": 10, "val_batch_size": 8, **kw})
    cfg["metrics"] = METRICS
    return cfg


@pytest.mark.parametrize("grad_mode", ["inference_mode", "no_grad"])
def test_config_metrics_equal_sklearn_over_the_whole_set_at_each_validation(tmp_path, grad_mode):
    from sklearn.metrics import f1_score, roc_auc_score

    trainer = ToyTrainer(metric_config(tmp_path, eval_grad_mode=grad_mode))
    metrics = trainer.fit()  # validations at 10 and 20: the second must not include the first
    x, y = trainer.val_loader.dataset.tensors
    probs = trainer.predict(x).softmax(dim=1)
    assert metrics["val/f1"] == pytest.approx(f1_score(y, probs.argmax(1), average="macro"), rel=1e-5)
    assert metrics["val/auroc"] == pytest.approx(
        roc_auc_score(y, probs, multi_class="ovr", average="macro"), rel=1e-5)
    assert metrics["val/acc"] == pytest.approx(float((probs.argmax(1) == y).float().mean()))


def test_no_host_sync_per_validation_batch(tmp_path):
    cfg = metric_config(tmp_path, max_steps=40, log_every_n_steps=20, val_every_n_steps=20)
    cfg["metrics"] = {"f1": METRICS["f1"]}  # AUROC's compute reads values (once, not per batch)
    trainer = ToyTrainer(cfg)
    with HostSyncCounter() as counter:
        trainer.fit()
    assert len(trainer.val_loader) == 8
    # one read per log point and per validation, one for the final save's check of the state
    assert counter.count == 2 + 2 + 1, counter.sites


class PerClass(ToyTrainer):
    def build_metrics(self):
        return {"acc_class": MulticlassAccuracy(3, average=None, validate_args=False)}


def test_a_vector_result_is_logged_per_class(tmp_path):
    metrics = PerClass(toy_config(tmp_path, max_steps=10, val_every_n_steps=10)).fit()
    assert {"val/acc_class/0", "val/acc_class/1", "val/acc_class/2"} <= set(metrics)


class Clash(ToyTrainer):
    def build_metrics(self):
        return {"acc": MulticlassF1Score(3, validate_args=False)}


class NotAMetric(ToyTrainer):
    def build_metrics(self):
        return {"f1": lambda logits, y: 0.0}


class Matrix(ToyTrainer):
    def build_metrics(self):
        from torchmetrics.classification import MulticlassConfusionMatrix
        return {"confusion": MulticlassConfusionMatrix(3, validate_args=False)}


class NeverUpdated(ToyTrainer):
    def build_metrics(self):
        return {"f1": MulticlassF1Score(3, validate_args=False)}

    def validation_step(self, batch):
        x, y = batch
        return {"loss": F.cross_entropy(self.model(x), y)}  # forgets self.metrics["f1"].update


@pytest.mark.parametrize("cls, match", [
    (NeverUpdated, "metric 'f1' was never updated during validation"),
    (Clash, "validation_step returns \\['acc'\\], which a metric"),
    (NotAMetric, "metric 'f1' is a function, not a torchmetrics.Metric"),
    (Matrix, "metric 'confusion' computed \\(3, 3\\)")])
def test_mistakes_are_named(tmp_path, cls, match):
    with pytest.raises(SaferunError, match=match):
        cls(toy_config(tmp_path, max_steps=2, val_every_n_steps=2)).fit()


def test_an_unsynced_metric_is_refused_under_torchrun(monkeypatch):
    """Each rank would report its own shard's value, and rank-local save_best decisions hang."""
    from saferun.loop.stateful import prepared_metrics

    unsynced = {"f1": MulticlassF1Score(3, sync_on_compute=False)}
    assert prepared_metrics(unsynced, torch.device("cpu"))  # one process: nothing to sync
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SaferunError, match="'f1' has sync_on_compute=False"):
        prepared_metrics(unsynced, torch.device("cpu"))


def test_configured_metrics_an_override_of_build_metrics_drops_are_refused(tmp_path):
    """`+metrics.auroc...` on the command line of a Trainer whose build_metrics ignores the
    config would never report val/auroc, and say nothing; merging super()'s is accepted."""
    cfg = toy_config(tmp_path, max_steps=2, val_every_n_steps=2)
    cfg["metrics"] = {"auroc": METRICS["auroc"], "off": None}  # a null node: switched off
    with pytest.raises(SaferunError, match=r"the config sets metrics.auroc, but build_metrics\(\) "
                                           r"returned \['f1'\]: this Trainer overrides"):
        NeverUpdated(cfg).setup()

    class Merged(ToyTrainer):
        def build_metrics(self):
            return {**super().build_metrics(), "f1": MulticlassF1Score(3, validate_args=False)}

    assert set(Merged(cfg).fit()) >= {"val/auroc", "val/f1"}
