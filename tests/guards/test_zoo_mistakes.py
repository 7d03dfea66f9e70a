"""Mistakes planted on real architectures (issue 33, items 8-13), each caught by a mechanism that
does not know the form it takes, with the cause named. The models are tests/zoo_models.py's."""

import logging

import pytest
import torch
from torch.utils.data import DataLoader

from saferun.config import load_config
from saferun.errors import SaferunError
from saferun.check import run_checks
from toys import toy_config

pytest.importorskip("transformers")
from zoo_models import ZooTrainer  # noqa: E402


def cfg(tmp_path, **trainer):
    c = toy_config(tmp_path, **{"max_steps": 3, "batch_size": 8, "log_every_n_steps": 3, **trainer})
    c["optim"] = {"_target_": "torch.optim.AdamW", "lr": 1e-3}
    return c


class Bert(ZooTrainer):
    arch = "bert"


class Llama(ZooTrainer):
    arch = "llama"


class T5(ZooTrainer):
    arch = "t5"


class Plain(torch.optim.Optimizer):
    """A user's own optimizer class (plain SGD): the check knows no optimizer by name."""

    def __init__(self, params, lr=1e-3):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


# ------------------------------------------------------------------ 8: the optimizer's parameters

def test_an_optimizer_over_another_models_parameters_is_refused(tmp_path):
    class Copy(Bert):
        def build_optimizer(self, params):
            return Plain(self.build_model().parameters())  # a second model, not the one trained

    with pytest.raises(SaferunError, match="holds a parameter of shape .* that is not in the model"):
        Copy(cfg(tmp_path)).fit()


def test_an_optimizer_over_part_of_a_trainable_model_is_refused(tmp_path):
    class HeadOnly(Bert):
        def build_optimizer(self, params):
            return Plain(self.model.classifier.parameters())

    with pytest.raises(SaferunError, match=r"bert\.embeddings\.word_embeddings\.weight.* are in no "
                                           r"optimizer \(the optimizer\), so they get gradients"):
        HeadOnly(cfg(tmp_path)).fit()


# ------------------------------------------------------------------ 13: a group that matches nothing

def test_a_parameter_group_that_matches_no_parameter_is_refused(tmp_path):
    class NoDecayByName(Llama):
        def build_optimizer(self, params):
            named = list(self.model.named_parameters())
            no_decay = [p for n, p in named if "LayerNorm" in n]  # Llama's norms are '...norm'
            return torch.optim.AdamW([{"params": [p for n, p in named if "LayerNorm" not in n]},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=1e-3)

    with pytest.raises(SaferunError, match=r"parameter group 1 \(\{'weight_decay': 0.0, 'lr': "
                                           r"0.001\}\) holds no parameter"):
        NoDecayByName(cfg(tmp_path)).fit()


# ------------------------------------------------------------------ 9: a graph kept alive

def test_a_graph_kept_on_the_trainer_is_named(tmp_path, caplog):
    class KeepsLosses(Llama):
        def training_step(self, batch):
            loss = super().training_step(batch)
            self.history = getattr(self, "history", {"losses": []})
            self.history["losses"].append(loss)  # every step's graph stays alive
            return loss

    with caplog.at_level(logging.WARNING, logger="saferun"):
        KeepsLosses(cfg(tmp_path)).fit()
    said = [r.getMessage() for r in caplog.records if "autograd graph" in r.getMessage()]
    assert len(said) == 1 and "\"history['losses'][0]\" on the Trainer holds" in said[0], said
    assert "loss.detach()" in said[0]


# ------------------------------------------------------------------ 10: the loop's jobs, done again

class Stepping(T5):
    def build_scheduler(self, optimizer):
        return torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)


class StepsScheduler(Stepping):
    def training_step(self, batch):
        self.scheduler.step()
        return super().training_step(batch)


class Clips(T5):
    def training_step(self, batch):
        loss = super().training_step(batch)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        return loss


class ZeroesGrads(T5):
    def training_step(self, batch):
        self.optimizer.zero_grad()
        return super().training_step(batch)


@pytest.mark.parametrize("cls, what, instead", [
    (StepsScheduler, r"StepLR\.step\(\)", "saferun steps the optimizer and the scheduler itself"),
    (Clips, r"torch\.nn\.utils\.clip_grad_norm_\(\)", "saferun clips the gradients itself before "
                                                     "the update: set trainer.max_grad_norm"),
    (ZeroesGrads, r"AdamW\.zero_grad\(\)", "saferun zeroes the gradients itself"),
])
def test_the_loops_own_jobs_in_training_step_are_refused_before_anything_changes(
        tmp_path, cls, what, instead):
    t = cls(cfg(tmp_path))
    t.setup()
    weights = {k: v.detach().clone() for k, v in t.model.state_dict().items()}
    rates = [g["lr"] for g in t.optimizer.param_groups]
    with pytest.raises(SaferunError, match=f"step 1: training_step called {what} itself "
                                           rf"\(refused before it changed any weight\): {instead}"):
        t.fit()
    assert all(torch.equal(v, t.model.state_dict()[k]) for k, v in weights.items())
    assert [g["lr"] for g in t.optimizer.param_groups] == rates


# ------------------------------------------------------------------ 11: targets against the loss

def test_padding_labels_the_loss_does_not_ignore_name_ignore_index(tmp_path):
    class PadsWithMinusOne(ZooTrainer):
        arch = "gpt2"

        def training_step(self, batch):
            labels = batch["labels"].clone()
            labels[:, -3:] = -1  # padded, but Hugging Face's loss ignores -100 only
            return self.model(input_ids=batch["input_ids"], labels=labels).loss

    with pytest.raises(SaferunError, match=r"Every out-of-range target is -1, a marker of positions "
                                           r"to skip \(padding, unlabelled\), but the loss's "
                                           r"ignore_index is -100: pass ignore_index=-1"):
        PadsWithMinusOne(cfg(tmp_path)).fit()


# ------------------------------------------------------------------ 12: input scale

def test_raw_pixel_values_are_named_as_the_cause(tmp_path):
    class RawPixels(ZooTrainer):
        arch = "vit"

        def training_step(self, batch):  # pixels as read from the file, 0..255
            pixels = (batch["pixel_values"].sigmoid() * 255).round()
            return self.model(pixel_values=pixels, labels=batch["labels"]).loss

    found = {r.name: r for r in run_checks(lambda c: RawPixels(c), load_config(cfg(tmp_path)),
                                           only=["initial loss"])}["initial loss"]
    assert found.status == "warn", found
    assert ("the inputs reach the model's first weight layer "
            "'vit.embeddings.patch_embeddings.projection' with a standard deviation of") in found.finding
    assert "unnormalised inputs" in found.finding and "output layer" not in found.finding


# ------------------------------------------------------------------ 13: what the loops see

def test_a_validation_loader_that_drops_samples_is_named(tmp_path, caplog):
    class DropsLast(Bert):
        def build_dataloaders(self, train, val):
            loader, _ = super().build_dataloaders(train, val)
            return loader, DataLoader(val, batch_size=6, drop_last=True)  # 16 samples: 4 dropped

    with caplog.at_level(logging.WARNING, logger="saferun"):
        DropsLast(cfg(tmp_path)).setup()
    said = [r.getMessage() for r in caplog.records if "validation loader" in r.getMessage()]
    assert len(said) == 1 and "yields 12 of the 16 samples" in said[0], said
    assert "drop_last=True drops the last 4" in said[0]


def test_batchnorm_at_an_effective_batch_of_one_is_named(tmp_path, caplog):
    class OneAtATime(ZooTrainer):
        arch = "resnet"

    with caplog.at_level(logging.WARNING, logger="saferun"):
        OneAtATime(cfg(tmp_path, batch_size=1)).fit()
    said = [r.getMessage() for r in caplog.records if "a batch of one sample" in r.getMessage()]
    assert len(said) == 1, said
    assert "BatchNorm 'resnet.embedder.embedder.normalization' (input [1, 8, 8, 8])" in said[0]
