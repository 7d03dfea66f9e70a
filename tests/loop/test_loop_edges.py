"""The loop's edges: a second fit(), max_epochs without max_steps (and both), a mode changed
during evaluation, habits from other frameworks (see docs/loop-edges.md)."""

import logging
import re

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from saferun import Callback
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


def test_a_second_fit_after_a_parameter_was_replaced_is_refused_naming_it(tmp_path):
    # module.weight = nn.Parameter(...) between two fits: the optimizer (and the gradient
    # accumulators fit() holds) still had the old one, so the second fit trained every other
    # parameter and left the new one at its values, silently
    t = ToyTrainer(toy_config(tmp_path, max_steps=4))
    t.fit()
    built_with = t.model.head.weight
    t.model.head.weight = nn.Parameter(t.model.head.weight.detach() * 0.5)
    t.cfg.trainer.max_steps = 8
    before = whole_state(t)
    with pytest.raises(SaferunError, match=r"'head.weight' is not the parameter the optimizer "
                       r"was built with.*copy_.*new Trainer"):
        t.fit()
    assert_same(whole_state(t), before)
    with torch.no_grad():  # the way the message says: in place, and the second fit trains it
        t.model.head.weight = built_with
        t.model.head.weight.mul_(0.5)
    changed = t.model.head.weight.detach().clone()
    t.fit()
    assert t.state.step == 8 and not torch.equal(t.model.head.weight, changed)


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


# ---------------------------------------------------------------- habits from other frameworks

class WithIndex(ToyTrainer):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch)


class ValidationWithIndex(ToyTrainer):
    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        return super().validation_step(batch)


class StepsItself(ToyTrainer):
    def training_step(self, batch):
        loss = super().training_step(batch)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss


class BackwardOnly(ToyTrainer):
    def training_step(self, batch):
        loss = super().training_step(batch)
        loss.backward()
        return loss


class StepsItsOwnOfSeveral(ToyTrainer):
    def build_optimizer(self, params):
        return {"all": torch.optim.SGD(params, lr=0.1)}

    def training_step(self, batch):
        loss = super().training_step(batch)
        loss.backward()
        self.optimizer["all"].step()


@pytest.mark.parametrize("trainer, hook, extra", [
    (WithIndex, "training_step(batch, batch_idx)", "batch_idx"),
    (ValidationWithIndex, "validation_step(batch, batch_idx, dataloader_idx)", "batch_idx"),
])
def test_a_step_hook_taking_a_batch_index_is_refused_at_setup(tmp_path, trainer, hook, extra):
    with pytest.raises(SaferunError, match=rf"{trainer.__name__}.{re.escape(hook)}: saferun calls "
                       rf"\w+\(batch\) with the batch alone, so {extra} would get no value.*"
                       r"self.step is the step being computed, as the logs count it"):
        trainer(toy_config(tmp_path)).setup()


@pytest.mark.parametrize("trainer, words", [
    (StepsItself, r"step 1: training_step called SGD.step\(\) itself \(refused before it changed "
                  r"any weight\).* remove loss.backward\(\), optimizer.step\(\) and zero_grad\(\) "
                  r"from training_step and return the loss.*self.optimize\(name, loss\)"),
    (BackwardOnly, r"step 1: training_step ran a backward itself .* no weight has changed"),
    (StepsItsOwnOfSeveral, r"step 1: training_step called SGD.step\(\) itself"),
])
def test_a_backward_or_optimizer_step_inside_training_step_is_refused_before_any_update(
        tmp_path, trainer, words):
    t = trainer(toy_config(tmp_path))
    t.setup()
    before = [p.detach().clone() for p in t.model.parameters()]  # (the forward moves BN buffers)
    with pytest.raises(SaferunError, match=words):
        t.fit()
    assert all(torch.equal(b, p) for b, p in zip(before, t.model.parameters()))  # no update


class BackwardLater(ToyTrainer):
    def training_step(self, batch):
        loss = super().training_step(batch)
        if self.state.step == 3:  # not at the first step: autograd's error, explained
            loss.backward()
        return loss


def test_a_later_backward_inside_training_step_gets_autograd_error_explained(tmp_path):
    with pytest.raises(SaferunError, match=r"step 4: autograd refused saferun's backward.*If "
                       r"training_step \(or code it calls\) ran loss.backward\(\) itself, remove"):
        BackwardLater(toy_config(tmp_path)).fit()


# ---------------------------------------------------------------- a stream's epochs

class NoisyItems(Dataset):
    """(x + noise, y), the noise drawn from torch's global RNG (no workers: the loop's own)."""

    def __init__(self, n: int = 96) -> None:
        self.x, self.y = make_classification(n)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.rand(self.x.shape[1]), self.y[i]


class NoisyStream(IterableDataset):
    """The same items, as a stream."""

    def __init__(self) -> None:
        self.items = NoisyItems()

    def __iter__(self):
        return (self.items[i] for i in range(len(self.items)))


class Validations(Callback):
    def __init__(self) -> None:
        self.seen = []

    def on_validation_end(self, view, metrics):
        self.seen.append((view.step, view.epoch, metrics["val/loss"]))


class MapData(ToyTrainer):
    def build_datasets(self):
        x, y = make_classification(32, seed=1)
        return NoisyItems(), TensorDataset(x, y)


class StreamData(MapData):
    def build_datasets(self):
        return NoisyStream(), super().build_datasets()[1]


def stream_run(cls, path, resume_from=False, **trainer):
    # 96 items of 16: 6 steps per epoch
    seen = Validations()
    cfg = toy_config(path, batch_size=16, shuffle=False, log_every_n_steps=3,
                     **{"max_steps": None, "max_epochs": 3, **trainer})
    cfg["resume"] = "auto" if resume_from else None
    t = cls(cfg, callbacks=[seen])
    t.fit()
    return t, seen.seen


def test_a_stream_ends_each_epoch_like_map_style_data(tmp_path):
    mapped, map_seen = stream_run(MapData, tmp_path / "map")
    stream, stream_seen = stream_run(StreamData, tmp_path / "stream")
    assert [(s, e) for s, e, _ in map_seen] == [(6, 0), (12, 1), (18, 2)]
    assert stream_seen == map_seen  # the same validations, labelled alike, the same values
    assert_same(whole_state(stream), whole_state(mapped))


@pytest.mark.parametrize("stop", [6, 8])  # at the epoch's end (its last step), and after it
def test_a_stream_resumes_at_and_across_an_epoch_end_exactly(tmp_path, stop):
    straight, seen = stream_run(StreamData, tmp_path / "a")
    _, first = stream_run(StreamData, tmp_path / "b", max_steps=stop)
    resumed, then = stream_run(StreamData, tmp_path / "b", resume_from=True)
    if stop % 6:  # a run's end validates; step 8 is not an epoch's end in the straight run
        assert first.pop()[:2] == (8, 1)
    assert first + then == seen
    assert_same(whole_state(resumed), whole_state(straight))


def _as_is(batch):
    return batch


class StoredBatches(Dataset):
    """Batches made once and kept (a dataset of pre-batched tensors): item i is the same list
    object every epoch."""

    def __init__(self) -> None:
        x, y = make_classification(64)
        self.batches = [[x[i:i + 16] * 255, y[i:i + 16]] for i in range(0, 64, 16)]

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i):
        return self.batches[i]


class ScalesInPlace(ToyTrainer):
    """training_step scales the inputs by rewriting its batch list (batch[0] = ...)."""

    def build_datasets(self):
        return StoredBatches(), None

    def build_dataloaders(self, train, val):
        from torch.utils.data import DataLoader
        return DataLoader(train, batch_size=None, collate_fn=_as_is), None

    def training_step(self, batch):
        self.seen.append(batch[0].clone())
        batch[0] = batch[0] / 255
        x, y = batch
        return torch.nn.functional.cross_entropy(self.model(x), y)


def test_a_training_step_that_rewrites_its_batch_list_leaves_the_loaders_batch_alone(tmp_path):
    # The batch saferun hands training_step is its own list, on the CPU as on a GPU: a step
    # that rewrites it in place (batch[0] = x / 255) must not rewrite the batch the loader
    # keeps and yields again next epoch (scaled twice: silently other data).
    trainer = ScalesInPlace(toy_config(tmp_path, max_steps=8, log_every_n_steps=4))
    trainer.seen = []
    stored = [[t.clone() for t in b] for b in trainer.build_datasets()[0].batches]
    trainer.fit()
    assert len(trainer.seen) == 8
    for step, x in enumerate(trainer.seen):  # epoch 2 sees the inputs epoch 1 saw
        assert torch.equal(x, stored[step % 4][0]), f"step {step + 1}"
