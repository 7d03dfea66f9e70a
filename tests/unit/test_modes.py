"""Guarantee 1 (modes) and 2 (evaluation leaves gradients and the graph alone)."""

import logging

import pytest
import torch

import saferun
from saferun import modes
from toys import Net, ToyTrainer, toy_config, weights


class RecordModes(ToyTrainer):
    """Records, at every training and validation step, the mode flags and grad mode."""

    def training_step(self, batch):
        self.train_seen.append((self.model.training, self.model.backbone.training,
                                self.model.dropout.training, torch.is_grad_enabled()))
        return super().training_step(batch)

    def validation_step(self, batch):
        out = super().validation_step(batch)
        self.val_seen.append((self.model.training, self.model.backbone[1].training,
                              torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                              out["loss"].requires_grad))
        return out


def make(cls, tmp_path, **kw):
    t = cls(toy_config(tmp_path, **kw))
    t.train_seen, t.val_seen = [], []
    return t


def test_training_in_train_mode_and_eval_in_eval_mode_with_inference_mode(tmp_path):
    t = make(RecordModes, tmp_path, max_steps=16, val_every_n_steps=4)
    t.fit()
    assert t.train_seen and all(s == (True, True, True, True) for s in t.train_seen)
    assert t.val_seen and all(s == (False, False, False, True, False) for s in t.val_seen)


def test_no_grad_eval_mode_is_configurable(tmp_path):
    t = make(RecordModes, tmp_path, max_steps=4, eval_grad_mode="no_grad")
    t.fit()
    assert all(s == (False, False, False, False, False) for s in t.val_seen)


def test_frozen_module_stays_eval_without_grad_and_out_of_optimizer(tmp_path):
    t = make(RecordModes, tmp_path, max_steps=16, val_every_n_steps=4, frozen_modules=["backbone"])
    t.setup()
    bn = t.model.backbone[1]
    stats_before = bn.running_mean.clone()
    frozen_params = {id(p) for p in t.model.backbone.parameters()}
    t.fit()
    # the frozen part stayed in eval through every step, also after each validation
    assert t.train_seen and all(s == (True, False, True, True) for s in t.train_seen)
    assert all(not p.requires_grad for p in t.model.backbone.parameters())
    in_optim = {id(p) for g in t.optimizer.param_groups for p in g["params"]}
    assert not in_optim & frozen_params
    assert torch.equal(bn.running_mean, stats_before)  # BN statistics did not drift


def test_validation_restores_every_submodule_flag_and_leaves_buffers_and_grads(tmp_path):
    t = make(ToyTrainer, tmp_path)
    t.setup()
    t.model.train()
    t.model.dropout.eval()  # a mixed state that model.train() afterwards would destroy
    flags = {n: m.training for n, m in t.model.named_modules()}
    for p in t.model.parameters():
        p.grad = torch.full_like(p, 0.5)
    before = weights(t)
    t.validate()
    assert {n: m.training for n, m in t.model.named_modules()} == flags
    after = weights(t)
    assert all(torch.equal(before[k], after[k]) for k in before)  # BN running stats included
    assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in t.model.parameters())


def test_evaluating_restores_flags_even_when_the_step_raises():
    model = Net()
    model.dropout.eval()
    flags = [m.training for m in model.modules()]
    with pytest.raises(RuntimeError):
        with modes.evaluating(model):
            raise RuntimeError("boom")
    assert [m.training for m in model.modules()] == flags


def test_model_loaded_in_eval_mode_is_put_in_train_mode_and_said_once(tmp_path, caplog):
    class EvalLoaded(RecordModes):
        def build_model(self):
            return super().build_model().eval()  # as pretrained loaders return it

    t = make(EvalLoaded, tmp_path, max_steps=8, val_every_n_steps=2)
    with caplog.at_level(logging.INFO, logger="saferun"):
        t.fit()
    assert all(s[0] and s[2] for s in t.train_seen)  # dropout is active in training
    said = [r for r in caplog.records if "was in eval mode" in r.getMessage()]
    assert len(said) == 1


def test_model_in_train_mode_is_not_reported(tmp_path, caplog):
    t = make(ToyTrainer, tmp_path, max_steps=2)
    with caplog.at_level(logging.INFO, logger="saferun"):
        t.fit()
    assert not [r for r in caplog.records if "was in eval mode" in r.getMessage()]


def test_unknown_frozen_module_is_a_config_error(tmp_path):
    t = make(ToyTrainer, tmp_path, frozen_modules=["backbon"])
    with pytest.raises(saferun.ConfigError, match="backbon.*Top-level submodules are: backbone"):
        t.setup()


@pytest.mark.parametrize("optim", [
    lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.5),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.5)])
def test_optimizer_over_all_parameters_with_a_frozen_part_warns_and_keeps_them(tmp_path, caplog, optim):
    """torch 2.13's optimizers skip parameters whose grad is None: a frozen part in the
    optimizer is harmless (a warning, not a refusal), and the frozen weights stay bitwise."""
    class AllParams(ToyTrainer):
        def build_optimizer(self, params):
            return optim(self.model.parameters())

    t = make(AllParams, tmp_path, frozen_modules=["backbone"], max_steps=6)
    t.setup()
    before = {k: v.clone() for k, v in t.model.backbone.state_dict().items()}
    head = t.model.head.weight.detach().clone()
    with caplog.at_level(logging.WARNING, logger="saferun"):
        t.fit()
    said = [r.getMessage() for r in caplog.records if "frozen parameters" in r.getMessage()]
    assert len(said) == 1 and "backbone.0.weight" in said[0] and "stay unchanged" in said[0]
    after = t.model.backbone.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # weights and BN buffers
    assert not torch.equal(head, t.model.head.weight)  # the rest trained
    frozen = {id(p) for p in t.model.backbone.parameters()}
    assert not any(id(p) in frozen for p in t.optimizer.state)  # no momentum/Adam state for them


def test_randomness_in_validation_does_not_change_training(tmp_path):
    class RandomVal(ToyTrainer):
        def validation_step(self, batch):
            torch.rand(100)  # e.g. a random crop in validation, in the main process
            return super().validation_step(batch)

    def train(every):
        t = RandomVal(toy_config(tmp_path / str(every), max_steps=12, val_every_n_steps=every))
        t.fit()
        return weights(t)

    a, b = train(3), train(12)
    assert all(torch.equal(a[k], b[k]) for k in a if "num_batches" not in k)
