"""Guarantee 6: optional compile, checked against eager, without the _orig_mod. prefix."""

import pytest
import torch
from torch import nn

from saferun.compile import CompileMismatchError
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
    compiled = NoDropout(toy_config(tmp_path, max_steps=5, compile=True, compile_backend=backend))
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
