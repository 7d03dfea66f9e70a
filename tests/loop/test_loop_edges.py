"""The loop's edges: a second fit(), max_epochs without max_steps (and both), a mode changed
during evaluation, habits from other frameworks (see docs/loop-edges.md)."""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from saferun.config import TrainerConfig
from saferun.errors import SaferunError
from toys import AugmentedTrainer, ToyTrainer, make_classification, toy_config, weights


def whole_state(t):
    """Parameters and buffers, the optimizer's and scheduler's state, the loop's counters."""
    return (weights(t), str(t.optimizer.state_dict()),
            str(t.scheduler.state_dict()) if t.scheduler is not None else None,
            (t.state.step, t.state.epoch, t.state.batches_in_epoch, t.state.samples_seen))


def assert_same(a, b):
    wa, wb = a[0], b[0]
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert a[1:] == b[1:]


# ---------------------------------------------------------------- a second fit()

def test_a_second_fit_continues_to_a_raised_limit_exactly_as_one_longer_run(tmp_path):
    # 4 steps per epoch: the first fit ends mid-epoch (step 5), the second crosses an epoch;
    # the samples draw augmentations from the global RNGs, as dropout does
    straight = AugmentedTrainer(toy_config(tmp_path / "a", max_steps=13))
    straight.fit()
    twice = AugmentedTrainer(toy_config(tmp_path / "b", max_steps=5))
    twice.fit()
    twice.cfg.trainer.max_steps = 13
    twice.fit()
    assert_same(whole_state(twice), whole_state(straight))


def test_a_second_fit_with_nothing_left_is_refused_saying_how_to_continue(tmp_path):
    t = ToyTrainer(toy_config(tmp_path, max_steps=4))
    t.fit()
    before = whole_state(t)
    with pytest.raises(SaferunError, match=r"fit\(\) already ran on this Trainer and ended at "
                       r"step 4.*trainer.cfg.trainer.max_steps = 8\), then call fit\(\)"):
        t.fit()
    assert_same(whole_state(t), before)


# ---------------------------------------------------------------- max_epochs and max_steps

class Tiny(ToyTrainer):
    """A linear model on single-sample batches: many cheap steps."""

    def build_model(self):
        return nn.Linear(8, 3)

    def build_datasets(self):
        x, y = make_classification(300)
        return TensorDataset(x, y), None


def test_max_epochs_alone_is_not_capped_by_the_default_max_steps(tmp_path):
    # 4 epochs of 300 steps: 1200 steps, past the 1000 steps max_steps defaults to alone
    t = Tiny(toy_config(tmp_path, max_steps=None, max_epochs=4, batch_size=1,
                        log_every_n_steps=300, save_every_n_steps=None))
    t.fit()
    assert (t.state.step, t.state.epoch) == (1200, 4)
    assert t.state.max_steps == 1200  # the planned length (the progress bar's total)


def test_the_step_default_applies_only_without_max_epochs_and_both_set_are_kept():
    assert TrainerConfig().max_steps == 1000
    assert TrainerConfig(max_epochs=10).max_steps is None
    assert (TrainerConfig(max_steps=30, max_epochs=10).max_steps,
            TrainerConfig(max_steps=30, max_epochs=10).max_epochs) == (30, 10)


def test_both_set_the_first_limit_ends_the_run_and_setup_says_which(tmp_path, caplog):
    t = ToyTrainer(toy_config(tmp_path, max_steps=12, max_epochs=3))  # 8 steps per epoch
    with caplog.at_level(logging.WARNING, logger="saferun"):
        t.fit()
    assert (t.state.step, t.state.epoch) == (12, 1)
    assert ("trainer.max_steps=12 ends this run after 1.5 of the trainer.max_epochs=3 epochs "
            "(8 steps each)") in caplog.text


# ---------------------------------------------------------------- modes during evaluation

class TrainsInValidation(ToyTrainer):
    def validation_step(self, batch):
        self.model.dropout.train()  # dropout on while evaluating: restored afterwards, unseen
        return super().validation_step(batch)


class TrainsInPredict(ToyTrainer):
    def predict_step(self, batch):
        self.model.head.train()  # (a BatchNorm set to train is found by guards.eval_purity)
        return self.model(batch[0])


def test_a_mode_changed_in_validation_step_is_refused_naming_module_and_hook(tmp_path):
    t = TrainsInValidation(toy_config(tmp_path, max_steps=8))
    with pytest.raises(SaferunError, match=r"step 8: module 'dropout' \(Dropout\) is in train "
                       r"mode during validation_step, which saferun runs in eval mode"):
        t.fit()


def test_a_mode_changed_in_predict_step_is_refused_naming_module_and_hook(tmp_path):
    t = TrainsInPredict(toy_config(tmp_path))
    t.setup()
    flags = [m.training for m in t.model.modules()]
    x, y = make_classification(16)
    with pytest.raises(SaferunError, match=r"step 0: module 'head' \(Linear\) is in train mode "
                       r"during predict_step"):
        t.predict(TensorDataset(x, y))
    assert [m.training for m in t.model.modules()] == flags  # restored as predict found them
