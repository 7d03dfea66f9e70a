"""The number of samples in a batch (Trainer.batch_size): it weighs each micro-batch's loss
under trainer.accumulate and each validation batch's metrics. A batch type the default cannot
count must be refused, not counted as 0 (which summed the micro-batches' mean losses, a
gradient `accumulate` times too large, and dropped the validation metrics, silently)."""

import collections

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


KINDS = {"dict": dict, "userdict": Encoding, "record": lambda d: Record(d["x"], d["y"])}


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


def test_a_userdict_batch_accumulates_and_validates_as_a_dict_does(tmp_path):
    want_t, want = run(tmp_path, "dict")
    got_t, got = run(tmp_path, "userdict")
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
