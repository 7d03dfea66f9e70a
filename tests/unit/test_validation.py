"""Validation: means weighted by batch size, over at most limit_val_batches batches."""

import torch
import torch.nn.functional as F

from toys import ToyTrainer, toy_config


class CountsBatches(ToyTrainer):
    def validation_step(self, batch):
        self.sizes.append(len(batch[0]))
        return super().validation_step(batch)


def expected_means(t, n):
    """The validation metrics over the first `n` validation samples, by hand."""
    x, y = t.val_loader.dataset.tensors
    t.model.eval()
    with torch.no_grad():
        logits = t.model(x[:n])
    t.model.train()
    return {"val/loss": F.cross_entropy(logits, y[:n]).item(),
            "val/acc": (logits.argmax(1) == y[:n]).float().mean().item()}


def test_limit_val_batches_uses_only_the_first_batches(tmp_path):
    t = CountsBatches(toy_config(tmp_path, max_steps=2, val_batch_size=24, limit_val_batches=2))
    t.sizes = []
    metrics = t.validate()
    assert t.sizes == [24, 24]  # of 64 samples: batches of 24, 24 and 16
    for k, v in expected_means(t, 48).items():
        assert abs(metrics[k] - v) < 1e-6, k


def test_means_are_weighted_by_batch_size(tmp_path):
    t = CountsBatches(toy_config(tmp_path, max_steps=2, val_batch_size=24))
    t.sizes = []
    metrics = t.validate()
    assert t.sizes == [24, 24, 16]
    for k, v in expected_means(t, 64).items():
        assert abs(metrics[k] - v) < 1e-6, k


class OwnLoaders(CountsBatches):
    def build_dataloaders(self, train, val):
        return (torch.utils.data.DataLoader(train, batch_size=32),
                torch.utils.data.DataLoader(val, batch_size=24))


def test_limit_val_batches_limits_a_loader_the_user_built(tmp_path):
    # saferun's own validation loader holds only the first limit x val_batch_size samples;
    # a user's loader is cut by the evaluation loop, at the same samples
    t = OwnLoaders(toy_config(tmp_path, max_steps=2, limit_val_batches=2))
    t.sizes = []
    metrics = t.validate()
    assert t.sizes == [24, 24]
    for k, v in expected_means(t, 48).items():
        assert abs(metrics[k] - v) < 1e-6, k
