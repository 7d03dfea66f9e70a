"""`saferun check` and the audits on real architectures (issue 33): no false pass (a check that
says PASS while testing nothing), no false alarm (a correct model told it is wrong)."""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from saferun.config import load_config
from saferun.check import run_checks
from saferun.guards.syncs import HostSyncCounter
from toys import ToyTrainer, toy_config

transformers = pytest.importorskip("transformers")
from zoo_models import ZooTrainer  # noqa: E402


def check(cls, tmp_path, only, **kw):
    cfg = toy_config(tmp_path, **{"max_steps": 4, "batch_size": 8, "log_every_n_steps": 2, **kw})
    cfg["optim"] = {"_target_": "torch.optim.AdamW", "lr": 1e-2}
    return {r.name: r for r in run_checks(lambda c: cls(c), load_config(cfg), only=only)}


class Llama(ZooTrainer):
    arch = "llama"


class Bert(ZooTrainer):
    arch = "bert"


class MixesBatch(nn.Module):
    """Planted: the MLP's output transposed and reshaped back (the batch dimension mixed)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        return y.transpose(0, 1).reshape(y.shape)


class LlamaMixesBatch(Llama):
    def build_model(self):
        model = super().build_model()
        model.model.layers[0].mlp = MixesBatch(model.model.layers[0].mlp)
        return model


# ------------------------------------------------------------------ false passes (1-3)

def test_batch_mixing_in_llama_is_caught_and_a_clean_llama_is_tested(tmp_path):
    # The rotary embedding's input never reaches the logits: the check must trace a point
    # that does, and say PASS only then.
    clean = check(Llama, tmp_path / "clean", ["batch independence"])["batch independence"]
    assert clean.status == "pass" and "samples are independent" in clean.finding, clean
    mixed = check(LlamaMixesBatch, tmp_path / "mixed", ["batch independence"])["batch independence"]
    assert mixed.status == "fail", mixed
    assert "module 'model.layers.0.mlp' mixes the rows of its input" in mixed.finding, mixed


def test_batch_independence_says_not_checked_when_nothing_reaches_the_output(tmp_path):
    class Constant(ToyTrainer):
        def build_model(self):
            return Ignores()

    class Ignores(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 3)
            self.bias = nn.Parameter(torch.zeros(3))

        def forward(self, x):
            self.lin(x)  # computed, not used
            return self.bias.expand(len(x), 3) * 1.0

    found = check(Constant, tmp_path, ["batch independence"])["batch independence"]
    assert found.status == "pass" and found.finding.startswith("not checked, because nothing that "
                                                               "follows the batch"), found


def test_input_baseline_runs_on_a_model_called_with_keywords_only(tmp_path):
    found = check(Llama, tmp_path, ["input baseline"])["input baseline"]
    assert found.status == "pass" and "real inputs" in found.finding, found


def test_initial_loss_is_compared_on_a_model_output_with_logits(tmp_path):
    class Hot(Bert):  # planted: a classifier head initialised 300x too large
        def build_model(self):
            model = super().build_model()
            with torch.no_grad():
                model.classifier.weight.mul_(1000)
            return model

    clean = check(Bert, tmp_path / "clean", ["initial loss"])["initial loss"]
    assert clean.status == "pass" and "ln(3)" in clean.finding, clean
    hot = check(Hot, tmp_path / "hot", ["initial loss"])["initial loss"]
    assert hot.status == "warn" and "mis-scaled" in hot.finding, hot


# ------------------------------------------------------------------ false alarms (4-7)

class TakesTurns(nn.Module):
    """A top-1 mixture of experts routed by step (expert 0 on odd calls, 1 on even ones), and
    an expert 2 no input is ever routed to."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(8, 3) for _ in range(3))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        return self.experts[self.calls % 2](x)


def test_routed_experts_are_not_called_unused_but_a_never_routed_one_is(tmp_path, caplog):
    class Routed(ToyTrainer):
        def build_model(self):
            return TakesTurns()

    with caplog.at_level(logging.WARNING, logger="saferun"):
        Routed(toy_config(tmp_path, max_steps=6, log_every_n_steps=3)).fit()
    said = [r.getMessage() for r in caplog.records if "no gradient" in r.getMessage()]
    assert len(said) == 1, said
    assert "in any of the first 6 steps: [experts.2.weight, experts.2.bias]" in said[0], said
    assert "if they are never meant to train, freeze them" in said[0]


def test_batch_independence_without_predict_step_uses_the_model_call(tmp_path):
    # BERT's batch is a dict: the default predict_step's model(batch) cannot run it.
    found = check(Bert, tmp_path, ["batch independence"])["batch independence"]
    assert found.status == "pass" and "samples are independent" in found.finding, found


def test_a_failing_predict_step_is_named_and_not_a_failure(tmp_path):
    class OnlySubmodules(ToyTrainer):
        def training_step(self, batch):
            x, y = batch
            return F.cross_entropy(self.model.head(self.model.dropout(self.model.backbone(x))), y)

        def predict_step(self, batch):
            raise KeyError("features")

    found = check(OnlySubmodules, tmp_path, ["batch independence"])["batch independence"]
    assert found.status == "skip" and "predict_step(batch) raised KeyError" in found.finding, found


def test_a_library_sync_names_the_users_call(tmp_path):
    found = check(Bert, tmp_path, ["host syncs"])["host syncs"]
    assert found.status == "warn", found
    assert "masking_utils.py" in found.finding and "called from your line" in found.finding
    assert "zoo_models.py" in found.finding and "self.model(**batch" in found.finding, found.finding


def test_host_only_reads_and_cpu_only_checks_are_not_syncs():
    moved = torch.arange(4).to("cpu")  # a batch moved to the run's device
    with HostSyncCounter() as counter:
        drop = torch.rand([])  # LayerDrop's draw: on the host in any run
        skip = bool(drop < 0.5)
        F.one_hot(torch.tensor([0, 2]).to("cpu"), num_classes=3)  # checked on CPU only
    assert counter.count == 0, dict(counter.sites)
    with HostSyncCounter() as counter:
        int(moved.sum())  # a read of device data
        F.one_hot(moved)  # num_classes=-1: reads the maximum on CUDA too
    lines = sorted(int(site.rsplit(":", 1)[1]) for site in counter.sites)
    assert len(lines) == 2 and counter.sites[f"{__file__}:{lines[0]}"] == 1, dict(counter.sites)
    assert skip in (True, False)


def test_wav2vec2_layerdrop_is_not_a_sync(tmp_path):
    class Wav2Vec2(ZooTrainer):
        arch = "wav2vec2"

    found = check(Wav2Vec2, tmp_path, ["host syncs"])["host syncs"]
    assert found.status == "pass", found


class KeepsLast(nn.Module):
    """Keeps a detached copy of its output to look at (as attention maps are kept)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.net(x)
        self.last = y.detach()
        return y


def test_a_detached_output_kept_on_the_module_is_not_state(tmp_path, caplog):
    class Keeps(ToyTrainer):
        def build_model(self):
            return KeepsLast()

    with caplog.at_level(logging.WARNING, logger="saferun"):
        Keeps(toy_config(tmp_path / "fit", max_steps=4, val_every_n_steps=2)).fit()
    assert not [r.getMessage() for r in caplog.records], caplog.records
    found = check(Keeps, tmp_path / "check", ["eval purity", "determinism"])
    assert all(r.status == "pass" for r in found.values()), found


def test_a_frozen_backbone_with_dropout_and_adapters_is_not_told_to_go_to_eval(tmp_path, caplog):
    class Lora(ToyTrainer):
        def build_model(self):
            model = nn.Module()
            model.backbone = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1), nn.ReLU())
            model.backbone.requires_grad_(False)
            model.adapter = nn.Sequential(nn.Linear(8, 2, bias=False), nn.Linear(2, 16, bias=False))
            model.head = nn.Linear(16, 3)
            model.forward = lambda x: model.head(model.backbone(x) + model.adapter(x))
            return model

    with caplog.at_level(logging.WARNING, logger="saferun"):
        Lora(toy_config(tmp_path, max_steps=2)).fit()
    assert not [r.getMessage() for r in caplog.records if "frozen" in r.getMessage()]


def test_low_cardinality_inputs_are_not_a_leak(tmp_path):
    class Tokens(ToyTrainer):
        def build_model(self):
            return nn.Sequential(nn.Embedding(5, 8), nn.Linear(8, 3))

        def build_datasets(self):
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(0, 5, (96,), generator=g)
            return TensorDataset(ids[:64], ids[:64] % 3), TensorDataset(ids[64:], ids[64:] % 3)

    found = check(Tokens, tmp_path, ["data overlap"])["data overlap"]
    assert found.status == "pass" and "not checked, because the training set repeats" in found.finding


def test_batchnorm_without_running_stats_is_by_design(tmp_path):
    class BatchStats(ToyTrainer):
        def build_model(self):
            return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16, track_running_stats=False),
                                 nn.ReLU(), nn.Linear(16, 3))

    found = check(BatchStats, tmp_path, ["batch independence"])["batch independence"]
    assert found.status == "pass" and "'1'" in found.finding and "by design" in found.finding, found


def test_batch_order_is_not_judged_at_batch_size_one(tmp_path):
    found = check(ToyTrainer, tmp_path, ["batch order"], batch_size=1)
    assert found["batch order"].status == "pass", found
    assert "one sample each" in found["batch order"].finding
