"""Guarantee 6: optional compile, checked against eager, without the _orig_mod. prefix."""

import pytest
import torch
from torch import nn

from saferun.errors import CompileMismatchError
from toys import Net, ToyTrainer, toy_config, weights


class NoDropout(ToyTrainer):
    """Compiled dropout draws other random numbers than eager; compare without it."""

    def build_model(self):
        net = Net()
        net.dropout = nn.Identity()
        return net


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_training_matches_eager_and_keeps_state_dict_keys(tmp_path, backend):
    eager = NoDropout(toy_config(tmp_path, max_steps=5))
    eager.fit()
    compiled = NoDropout(toy_config(tmp_path / "compiled", max_steps=5, compile=True,
                                    compile_backend=backend))
    compiled.fit()
    keys = list(compiled.model.state_dict())
    assert keys == list(eager.model.state_dict())
    assert not any("_orig_mod" in k for k in keys)
    we, wc = weights(eager), weights(compiled)
    for k in we:
        torch.testing.assert_close(wc[k], we[k], rtol=1e-4, atol=1e-5)


def test_a_model_compiled_by_the_user_is_unwrapped(tmp_path):
    class PreCompiled(ToyTrainer):
        def build_model(self):
            return torch.compile(Net(), backend="eager")

    t = PreCompiled(toy_config(tmp_path, max_steps=2, compile=True, compile_backend="eager"))
    t.fit()
    assert not any("_orig_mod" in k for k in t.model.state_dict())


class CompilerSensitive(Net):
    """Computes something else when traced by the compiler: a planted compile bug."""

    def forward(self, x):
        out = super().forward(x)
        return out * 3 if torch.compiler.is_compiling() else out


def test_compiled_output_that_differs_from_eager_stops_the_run_with_both_values(tmp_path):
    class Planted(ToyTrainer):
        def build_model(self):
            return CompilerSensitive()

    t = Planted(toy_config(tmp_path, max_steps=2, compile=True, compile_backend="eager"))
    with pytest.raises(CompileMismatchError, match=r"eager loss [\d.]+, compiled [\d.]+") as e:
        t.fit()
    assert "trainer.compile=false" in str(e.value)
    assert t.state.step == 0  # stopped before any update


class TrainBranchDiffers(Net):
    """Only the training-mode graph computes something else under the compiler."""

    def forward(self, x):
        out = super().forward(x)
        return out * 3 if self.training and torch.compiler.is_compiling() else out


class BufferUpdateDiffers(Net):
    """Same loss and gradients, but the compiled training forward updates a buffer differently
    (as a miscompiled BatchNorm running-statistics update would)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        if self.training:
            self.seen.add_(2.0 if torch.compiler.is_compiling() else 1.0)
        return super().forward(x)


@pytest.mark.parametrize("model, said", [
    (TrainBranchDiffers, r"training mode.*eager loss [\d.]+, compiled [\d.]+"),
    (BufferUpdateDiffers, r"training mode.*buffer 'seen'"),
])
def test_a_training_graph_that_differs_from_eager_stops_the_run(tmp_path, model, said):
    class Planted(ToyTrainer):
        def build_model(self):
            return model()

    t = Planted(toy_config(tmp_path, max_steps=2, compile=True, compile_backend="eager"))
    with pytest.raises(CompileMismatchError, match=said) as e:
        t.fit()
    assert "trainer.compile=false" in str(e.value)
    assert t.state.step == 0


def _rng_states():
    import random

    import numpy as np
    return random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state()


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_the_check_leaves_model_gradients_rng_and_loader_as_found_and_handles_dropout(
        tmp_path, backend):
    from torch.utils.data import DataLoader

    class UserLoader(ToyTrainer):  # a loader with its own generator, which the check must not move
        def build_dataloaders(self, train, val):
            return DataLoader(train, batch_size=32, shuffle=True,
                              generator=torch.Generator().manual_seed(1)), None

    # Net has BatchNorm (its running statistics move in a training forward) and Dropout
    t = UserLoader(toy_config(tmp_path, compile=True, compile_backend=backend))
    t.setup()
    for p in t.model.parameters():
        p.grad = torch.full_like(p, 0.5)  # gradients the check must put back
    t.model.head.eval()  # a mode the check must put back
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    modes = [m.training for m in t.model.modules()]
    rng, loader_rng = _rng_states(), t.train_loader.generator.get_state()
    t._check_compile()  # raises if eager and compiled differ (dropout draws the same numbers)
    after = t.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in t.model.parameters())
    assert [m.training for m in t.model.modules()] == modes
    now = _rng_states()
    assert now[:2] == rng[:2] and torch.equal(now[2], rng[2])
    assert torch.equal(t.train_loader.generator.get_state(), loader_rng)
