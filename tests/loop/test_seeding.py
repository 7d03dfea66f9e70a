"""Guarantee 5: one seed makes runs with workers and random augmentation reproducible."""

import pytest
import torch

from saferun.data import make_loader, set_loader_epoch
from toys import AugmentedTrainer, DrawsDataset, toy_config, weights


def train(tmp_path, seed, context, name):
    cfg = toy_config(tmp_path / name, max_steps=8, num_workers=2, multiprocessing_context=context,
                     batch_size=16)
    cfg["seed"] = seed
    t = AugmentedTrainer(cfg)
    t.fit()
    return weights(t)


@pytest.mark.parametrize("context", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_same_seed_same_weights_other_seed_other_weights(tmp_path, context):
    a, b, c = (train(tmp_path, 1, context, "a"), train(tmp_path, 1, context, "b"),
               train(tmp_path, 2, context, "c"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def epoch_draws(loader, epoch):
    set_loader_epoch(loader, seed=5, epoch=epoch)
    return torch.cat(list(loader))


@pytest.mark.parametrize("context", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_workers_and_epochs_draw_differently_and_reproducibly(context):
    def loader():
        return make_loader(DrawsDataset(), batch_size=2, shuffle=False, drop_last=False,
                           num_workers=2, pin_memory=False, seed=5, multiprocessing_context=context)

    first, second = loader(), loader()
    e0, e1 = epoch_draws(first, 0), epoch_draws(first, 1)
    by_worker = {int(w): row for w, *row in e0.tolist()}
    assert set(by_worker) == {0, 1}
    assert by_worker[0] != by_worker[1]  # random, numpy and torch all differ across workers
    assert all(a != b for a, b in zip(by_worker[0], by_worker[1]))
    assert not torch.equal(e0[:, 1:], e1[:, 1:])  # and across epochs
    assert torch.equal(e0, epoch_draws(second, 0))  # and a new loader repeats them
