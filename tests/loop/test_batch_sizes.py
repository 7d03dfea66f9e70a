"""The number of samples in a batch (Trainer.batch_size): it weighs each micro-batch's loss
under trainer.accumulate and each validation batch's metrics. A batch type the default cannot
count must be refused, not counted as 0 (which summed the micro-batches' mean losses, a
gradient `accumulate` times too large, and dropped the validation metrics, silently)."""

import collections

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from saferun.errors import SaferunError
from toys import ToyTrainer, toy_config, weights


class Encoding(collections.UserDict):
    """As transformers' BatchEncoding: a UserDict (not a dict) with its own .to()."""

    def to(self, device, non_blocking=False):
        return Encoding({k: v.to(device, non_blocking=non_blocking) for k, v in self.items()})


class Record:
    """A batch class of the user's own, with .to() and no fields saferun can see."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def to(self, device, non_blocking=False):
        return Record(self.x.to(device), self.y.to(device))


KINDS = {"dict": dict, "userdict": Encoding, "record": lambda d: Record(d["x"], d["y"]),
         "weighted": lambda d: {"weight": torch.tensor(1.0), **d}}  # a 0-dim tensor first


class Batches(ToyTrainer):
    n_train, n_val = 40, 20  # batches of 16: micro-batches 16, 16 and 8; validation 16 and 4
    kind = "dict"

    def build_collate_fn(self):
        def collate(samples):
            x, y = torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])
            return KINDS[self.kind]({"x": x, "y": y})
        return collate

    def training_step(self, batch):
        return F.cross_entropy(self.model(batch.x if self.kind == "record" else batch["x"]),
                               batch.y if self.kind == "record" else batch["y"])

    def validation_step(self, batch):
        return {"loss": self.training_step(batch)}


def run(tmp_path, kind, accumulate=3):
    t = Batches(toy_config(tmp_path / kind, batch_size=16, accumulate=accumulate, max_steps=1,
                           shuffle=False))
    t.kind = kind
    return t, t.fit()


@pytest.mark.parametrize("kind", ["userdict", "weighted"])
def test_a_userdict_batch_or_one_with_a_0_dim_tensor_first_counts_as_a_dict_does(tmp_path, kind):
    # (weighted: the 0-dim tensor was counted as 1 sample, so the micro-batches 16, 16 and 8
    # weighed alike and the validation batches 16 and 4 too: silently other weights)
    want_t, want = run(tmp_path, "dict")
    got_t, got = run(tmp_path, kind)
    assert got["train/loss"] == want["train/loss"] and got["val/loss"] == want["val/loss"]
    for k, v in weights(want_t).items():  # the whole state: parameters and buffers
        assert torch.equal(weights(got_t)[k], v), k
    assert got_t.state.samples_seen == want_t.state.samples_seen == 40


@pytest.mark.parametrize("accumulate, where", [(3, "micro-batch 1 of 3"),
                                               (1, "step 1")])  # (samples_seen would be 0)
def test_a_batch_the_default_cannot_count_is_refused(tmp_path, accumulate, where):
    with pytest.raises(SaferunError, match=f"{where}: Trainer.batch_size\\(batch\\) returned 0 "
                       f"for a batch of type Record") as e:
        run(tmp_path, "record", accumulate)
    assert "override batch_size(batch)" in str(e.value)


def test_validation_batches_the_default_cannot_count_are_refused(tmp_path):
    class Counted(Batches):  # training counts its batches; validation's are Records
        def batch_size(self, batch):
            return 16 if self.model.training else super().batch_size(batch)

    t = Counted(toy_config(tmp_path, batch_size=16, max_steps=1, shuffle=False))
    t.kind = "record"
    with pytest.raises(SaferunError, match="validation batch 1: Trainer.batch_size"):
        t.fit()


def _counted_as(whole):
    class Counted(ToyTrainer):
        def batch_size(self, batch):
            return whole(batch[0].shape[0])
    return Counted


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("whole", [np.int64, torch.tensor, float], ids=["numpy", "tensor", "float"])
def test_a_whole_number_of_another_type_counts_as_that_int(tmp_path, whole, accumulate):
    # A NumPy integer reached samples_seen and the first checkpoint refused it (blaming the
    # checkpoint state); a 0-dim tensor, made under inference mode, was shared by every
    # validation key's count and added to in place: val/loss and val/acc silently too small.
    def run(trainer, name):
        t = trainer(toy_config(tmp_path / name, batch_size=24, accumulate=accumulate, max_steps=2,
                               shuffle=False))  # validation batches of 24, 24 and 16
        return t, {k: v for k, v in t.fit().items() if not k.startswith("perf/")}
    want_t, want = run(ToyTrainer, "int")
    got_t, got = run(_counted_as(whole), "other")
    assert got == want and "val/acc" in want
    for k, v in weights(want_t).items():
        assert torch.equal(weights(got_t)[k], v), k
    assert type(got_t.state.samples_seen) is int and got_t.state.samples_seen == 48 * accumulate


@pytest.mark.parametrize("value", [2.5, True, torch.ones(2)], ids=["fraction", "bool", "vector"])
def test_a_count_that_is_not_a_whole_number_is_refused(tmp_path, value):
    t = _counted_as(lambda n: value)(toy_config(tmp_path, batch_size=24, max_steps=1))
    with pytest.raises(SaferunError, match="step 1: Trainer.batch_size\\(batch\\) returned"):
        t.fit()


def test_an_empty_batch_is_refused_as_empty(tmp_path):
    # (before: the advice to override batch_size for a batch type it could not count)
    class Filtered(ToyTrainer):  # a collate_fn that drops every sample of the second batch
        def build_collate_fn(self):
            def collate(samples):
                x, y = torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])
                return (x[:0], y[:0]) if self.state.step == 1 and self.model.training else (x, y)
            return collate

    with pytest.raises(SaferunError, match=r"step 2: .* returned 0 for a batch of type tuple, which "
                       r"holds no samples \(batch\[0\], batch\[1\] of 0 rows"):
        Filtered(toy_config(tmp_path, batch_size=8, max_steps=3)).fit()


def test_the_default_count_of_a_batch_of_0_dim_tensors_is_one():
    from saferun.data.transfer import batch_size_of
    assert batch_size_of((torch.tensor(3.0), torch.tensor(1))) == 1
    assert batch_size_of({"w": torch.tensor(2.0), "x": [torch.zeros(0, 2), torch.zeros(5, 2)]}) == 5
    assert batch_size_of({"ids": [1, 2]}) == 0


def test_the_hook_counts_each_training_micro_batch_once(tmp_path):
    class Counting(Batches):
        calls = 0

        def batch_size(self, batch):
            Counting.calls += self.model.training
            return super().batch_size(batch)

    t = Counting(toy_config(tmp_path, batch_size=16, accumulate=3, max_steps=1, shuffle=False,
                            val_every_n_steps=None))
    t.fit()
    assert Counting.calls == 3  # micro-batches of 16, 16 and 8 (the user's hook may be costly)


def test_a_batch_size_set_on_the_instance_counts_the_samples_too(tmp_path):
    # (the loop counts with batch_size_of directly only where batch_size is not overridden: on
    # the class, or on the instance as here)
    t = ToyTrainer(toy_config(tmp_path, batch_size=16, max_steps=3))
    t.batch_size = lambda batch: 5
    t.fit()
    assert t.state.samples_seen == 15
