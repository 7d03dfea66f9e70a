"""The setup-time prediction of a BatchNorm's last batch of one, under the samplers in use."""

import torch
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

from saferun.data import make_loader
from saferun.guards.datachecks import last_batch_of_one

MODEL = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))


def data(n):
    return TensorDataset(torch.randn(n, 4))


def test_per_rank_under_a_distributed_sampler():
    # 66 samples, batch 32: one process gets 32 + 32 + 2 (fine); each of 2 ranks gets 33 = 32 + 1
    one = make_loader(data(66), batch_size=32, shuffle=True, drop_last=False, num_workers=0,
                      pin_memory=False, seed=0)
    assert last_batch_of_one(MODEL, [], one) is None
    two = make_loader(data(66), batch_size=32, shuffle=True, drop_last=False, num_workers=0,
                      pin_memory=False, seed=0, rank=1, world_size=2)  # saferun's DistributedSampler
    assert isinstance(two.batch_sampler.batch_sampler.sampler, DistributedSampler)
    found = last_batch_of_one(MODEL, [], two, world_size=2)
    assert found and "33 samples per rank (2 ranks) % batch_size 32 == 1" in found


def test_not_said_with_drop_last_or_a_frozen_batchnorm_or_none():
    loader = make_loader(data(65), batch_size=32, shuffle=False, drop_last=False, num_workers=0,
                         pin_memory=False, seed=0)
    assert "trainer.drop_last=true" in last_batch_of_one(MODEL, [], loader)
    assert last_batch_of_one(MODEL, [MODEL[1]], loader) is None  # declared frozen: eval mode
    assert last_batch_of_one(nn.Linear(4, 4), [], loader) is None
    dropped = make_loader(data(65), batch_size=32, shuffle=False, drop_last=True, num_workers=0,
                          pin_memory=False, seed=0)
    assert last_batch_of_one(MODEL, [], dropped) is None
