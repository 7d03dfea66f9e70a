"""Exact resume with a DataLoader the user built: its shuffle order and worker seeds come from
the global RNG (or its own generators) at the start of each epoch, so the checkpoint carries
that epoch-start state and resume replays the interrupted epoch from it."""

import logging

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, Sampler

import saferun
from toys import AugmentedTrainer, toy_config, weights

# AugmentedDataset: 128 samples with random noise from random, NumPy and torch; batches of 16:
# 8 steps per epoch, so 20 steps run two whole epochs and part of a third.
STEPS = 20


class UserLoader(AugmentedTrainer):
    """Builds its own training loader: `kind` says where its shuffle order comes from."""

    def __init__(self, cfg, kind="global", workers=0):
        self.curve = Curve()
        super().__init__(cfg, callbacks=[self.curve])
        self.kind, self.workers = kind, workers

    def build_dataloaders(self, train, val):
        args = dict(batch_size=16, num_workers=self.workers,
                    multiprocessing_context="fork" if self.workers else None)
        if self.kind == "global":  # RandomSampler seeded from the global torch RNG each epoch
            return DataLoader(train, shuffle=True, **args), None
        if self.kind == "loader_generator":  # the loader's generator: order and worker seeds
            return DataLoader(train, shuffle=True, generator=torch.Generator().manual_seed(3),
                              **args), None
        sampler = RandomSampler(train, generator=torch.Generator().manual_seed(4))
        return DataLoader(train, sampler=sampler, **args), None


class Curve(saferun.Callback):
    """The logged training loss at every step."""

    def __init__(self):
        self.losses = {}

    def on_log(self, view, metrics):
        self.losses[view.step] = metrics["train/loss"]


def config(tmp_path, name, steps, resume=None):
    cfg = toy_config(tmp_path, max_steps=steps, batch_size=16, log_every_n_steps=1,
                     save_every_n_steps=None)
    cfg["trainer"]["run_dir"] = str(tmp_path / name)
    cfg["optim"] = {"_target_": "torch.optim.SGD", "lr": 0.05, "momentum": 0.9}
    cfg["resume"] = resume
    return cfg


def assert_same_state(a, b):
    wa, wb = weights(a), weights(b)  # parameters and buffers (BatchNorm running statistics)
    assert list(wa) == list(wb)
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    oa, ob = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert oa["param_groups"] == ob["param_groups"]
    for i in oa["state"]:
        assert torch.equal(oa["state"][i]["momentum_buffer"], ob["state"][i]["momentum_buffer"]), i


@pytest.mark.parametrize("kind, workers, stop", [
    ("global", 0, 3),              # mid first epoch
    ("global", 0, 8),              # at the first epoch boundary
    ("global", 0, 12),             # mid second epoch
    ("global", 2, 19),             # workers with random augmentation, mid third epoch
    ("loader_generator", 2, 12),   # the loader's own generator draws order and worker seeds
    ("sampler_generator", 0, 16),  # the sampler's own generator, at the second boundary
])
def test_user_loader_resumes_exactly(tmp_path, kind, workers, stop):
    straight = UserLoader(config(tmp_path, "straight", STEPS), kind, workers)
    straight.fit()
    UserLoader(config(tmp_path, "split", stop), kind, workers).fit()  # checkpoint at `stop`
    resumed = UserLoader(config(tmp_path, "split", STEPS, resume="auto"), kind, workers)
    resumed.fit()
    assert resumed.state.step == STEPS
    assert_same_state(resumed, straight)
    assert resumed.curve.losses == {s: v for s, v in straight.curve.losses.items() if s > stop}


class NumpySampler(Sampler):
    """Shuffles with its own NumPy generator, whose state saferun cannot see."""

    def __init__(self, n):
        self.n, self.rng = n, np.random.default_rng(0)

    def __iter__(self):
        return iter(self.rng.permutation(self.n).tolist())

    def __len__(self):
        return self.n


class NumpySamplerTrainer(AugmentedTrainer):
    def build_dataloaders(self, train, val):
        return DataLoader(train, batch_size=16, sampler=NumpySampler(len(train))), None


class PersistentWorkers(AugmentedTrainer):
    def build_dataloaders(self, train, val):
        return DataLoader(train, batch_size=16, shuffle=True, num_workers=1,
                          persistent_workers=True, multiprocessing_context="fork"), None


@pytest.mark.parametrize("trainer, said", [
    (NumpySamplerTrainer, "sampler.rng: a numpy.random.Generator"),
    (PersistentWorkers, "persistent_workers=True"),
])
def test_a_loader_that_cannot_resume_exactly_is_named_at_setup(tmp_path, caplog, trainer, said):
    with caplog.at_level(logging.WARNING, logger="saferun"):
        trainer(config(tmp_path, "run", 2)).setup()
    warnings = [r.getMessage() for r in caplog.records if "resume" in r.getMessage()]
    assert len(warnings) == 1 and said in warnings[0], warnings
    assert "not exact" in warnings[0]


def test_builtin_loaders_raise_no_resume_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="saferun"):
        UserLoader(config(tmp_path, "run", 2), "sampler_generator").setup()
        AugmentedTrainer(config(tmp_path, "run2", 2)).setup()
    assert not [r for r in caplog.records if "resume" in r.getMessage()]


class StatefulNumpySampler(NumpySampler):
    """The same sampler, with the state_dict()/load_state_dict() pair saferun saves."""

    def state_dict(self):
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state):
        self.rng.bit_generator.state = state["rng"]


class StatefulSamplerTrainer(UserLoader):
    def build_dataloaders(self, train, val):
        return DataLoader(train, batch_size=16, sampler=StatefulNumpySampler(len(train))), None


def test_a_sampler_with_its_own_state_dict_resumes_exactly_without_warning(tmp_path, caplog):
    straight = StatefulSamplerTrainer(config(tmp_path, "straight", STEPS))
    with caplog.at_level(logging.WARNING, logger="saferun"):
        straight.fit()
    assert not [r for r in caplog.records if "resume" in r.getMessage()]
    StatefulSamplerTrainer(config(tmp_path, "split", 12)).fit()
    resumed = StatefulSamplerTrainer(config(tmp_path, "split", STEPS, resume="auto"))
    resumed.fit()
    assert_same_state(resumed, straight)
