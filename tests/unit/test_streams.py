"""Iterable datasets: split across DataLoader workers (and ranks, see
tests/parallel/test_ddp_paths.py), refused when every worker would read them whole,
resumed exactly."""

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

import saferun
from saferun.data import ShardedStream, make_loader, shard_index
from toys import ToyTrainer, make_classification, toy_config, weights


class Ids(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(torch.arange(self.n))


class WhereAmI(IterableDataset):
    def __iter__(self):
        yield torch.tensor(shard_index())


class Noisy(IterableDataset):
    """(x + noise, y): the noise comes from the worker's torch RNG, which saferun seeds."""

    def __init__(self, n: int = 96) -> None:
        self.x, self.y = make_classification(n)

    def __iter__(self):
        for x, y in zip(self.x, self.y):
            yield x + 0.1 * torch.rand(x.shape), y


class StreamTrainer(ToyTrainer):
    def __init__(self, cfg: Any, raw: bool = False) -> None:
        super().__init__(cfg)
        self.raw = raw

    def build_datasets(self):
        return (Noisy() if self.raw else ShardedStream(Noisy())), None


@pytest.mark.slow  # spawned workers import torch: about 10 s on 2 cores
def test_shard_index_in_spawned_workers_reads_the_rank_from_the_environment(monkeypatch):
    # spawned workers do not inherit torch.distributed's state, only the environment
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    loader = DataLoader(WhereAmI(), batch_size=None, num_workers=2,
                        multiprocessing_context="spawn")
    assert sorted(tuple(t.tolist()) for t in loader) == [(2, 4), (3, 4)]


def test_a_sharded_stream_gives_each_worker_its_own_items_and_keeps_the_tail():
    loader = DataLoader(ShardedStream(Ids(9)), batch_size=None, num_workers=2)
    assert sorted(int(t) for t in loader) == list(range(9))  # one process: nothing dropped


@pytest.mark.parametrize("evaluation", [False, True])
def test_under_torchrun_training_drops_an_uneven_last_round_and_evaluation_keeps_it(
        monkeypatch, evaluation):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")  # read by ShardedStream only: no process group
    loader = make_loader(ShardedStream(Ids(9)), batch_size=1, shuffle=False, drop_last=False,
                         num_workers=0, pin_memory=False, seed=0, evaluation=evaluation)
    kept = [int(t) for t in loader]
    # every rank must get as many training batches; evaluation counts every sample once
    assert kept == ([0, 2, 4, 6, 8] if evaluation else [0, 2, 4, 6])


def test_a_stream_every_worker_would_read_whole_is_refused(tmp_path):
    trainer = StreamTrainer(toy_config(tmp_path, num_workers=2, batch_size=16), raw=True)
    with pytest.raises(saferun.SaferunError, match="IterableDataset.*2 DataLoader workers"):
        trainer.fit()


def test_a_sharded_stream_with_workers_resumes_exactly(tmp_path):
    # 96 items, 2 workers of 48: 3 batches each, 6 per epoch; stop mid-epoch 0, end in epoch 1
    def cfg(name, steps, resume=None):
        c = toy_config(tmp_path / name, num_workers=2, batch_size=16, max_steps=steps,
                       log_every_n_steps=2)
        c["resume"] = resume
        c["guards"] = {"preflight": False}  # its worker checks cost seconds; not the point here
        return c

    straight = StreamTrainer(cfg("a", 8))
    straight.fit()
    StreamTrainer(cfg("b", 4)).fit()
    resumed = StreamTrainer(cfg("b", 8, resume="auto"))
    resumed.fit()
    a, b = weights(straight), weights(resumed)
    assert resumed.state.step == 8 and resumed.state.epoch == 1
    assert all(torch.equal(a[k], b[k]) for k in a)
