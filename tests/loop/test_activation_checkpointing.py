"""trainer.activation_checkpointing: the same training as without it (parameters, buffers,
optimizer state, the logged curve), less activation memory, and a clear error for a class name
the model does not have."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from saferun.errors import ConfigError
from toys import ToyTrainer, toy_config


class Block(nn.Module):
    """Linear, BatchNorm (running statistics updated in the forward) and Dropout (random)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)
        self.dropout = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(F.gelu(self.norm(self.linear(x))))


class Tower(nn.Module):
    def __init__(self, dim: int = 8, width: int = 64, depth: int = 3, classes: int = 3) -> None:
        super().__init__()
        self.stem = nn.Linear(dim, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class TowerTrainer(ToyTrainer):
    def build_model(self) -> nn.Module:
        return Tower()


def run(tmp_path: Any, name: str, **trainer: Any) -> dict[str, Any]:
    cfg = toy_config(tmp_path / name, max_steps=12, log_every_n_steps=2, val_every_n_steps=4, **trainer)
    cfg["optim"] = {"_target_": "torch.optim.AdamW", "lr": 1e-2}
    cfg["trainer"]["ema"] = {"decay": 0.9}
    cfg["logger"] = {"jsonl": {"_target_": "saferun.loggers.MetricsJsonl"}}
    t = TowerTrainer(cfg)
    t.fit()
    lines = [json.loads(line) for line in (tmp_path / name / "run" / "metrics.jsonl").read_text().splitlines()]
    return {"model": t.model.state_dict(), "optimizer": t.optimizer.state_dict(),
            "curve": [{k: v for k, v in line.items() if k != "time" and not k.startswith("perf/")}
                      for line in lines]}


def assert_same_training(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert list(got["model"]) == list(want["model"])  # checkpoint keys unchanged
    for k, v in want["model"].items():  # parameters, BatchNorm statistics, num_batches_tracked
        assert torch.equal(got["model"][k], v), k
    for i, state in want["optimizer"]["state"].items():
        for k, v in state.items():
            assert torch.equal(got["optimizer"]["state"][i][k], v), (i, k)
    assert got["curve"] == want["curve"]  # train and val losses, EMA's val_ema/*


def test_checkpointed_blocks_train_exactly_as_without(tmp_path):
    want = run(tmp_path, "plain")
    got = run(tmp_path, "checkpointed", activation_checkpointing=["Block"])
    # BatchNorm's statistics were updated once per step, not once more by the recompute
    assert int(got["model"]["blocks.0.norm.num_batches_tracked"]) == 12
    assert_same_training(got, want)


def saved_activation_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd keeps for the backward of one forward (deterministic, no timing)."""
    kept = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal kept
        kept += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).sum()
    loss.backward()
    return kept


def test_checkpointing_keeps_fewer_activations(tmp_path):
    models = {}
    for names in ([], ["Block"]):
        t = TowerTrainer(toy_config(tmp_path / str(len(names)), activation_checkpointing=names))
        t.setup()
        models[bool(names)] = t.model
    x = torch.randn(256, 8)
    plain, checkpointed = (saved_activation_bytes(models[k], x) for k in (False, True))
    # each block keeps only its input instead of its linear, norm, gelu and dropout activations
    assert checkpointed < plain / 2, (checkpointed, plain)


def test_an_unknown_class_name_is_refused_with_the_models_classes(tmp_path):
    with pytest.raises(ConfigError) as e:
        TowerTrainer(toy_config(tmp_path, activation_checkpointing=["Blok"])).setup()
    msg = str(e.value)
    assert "trainer.activation_checkpointing" in msg and "'Blok'" in msg
    assert "Did you mean 'Block'?" in msg and "Tower" in msg


def test_nested_matches_checkpoint_the_outermost_module_once(tmp_path):
    t = TowerTrainer(toy_config(tmp_path, activation_checkpointing=["Block", "BatchNorm1d"]))
    t.setup()
    from torch.distributed._composable.contract import _get_registry

    wrapped = [n for n, m in t.model.named_modules() if "checkpoint" in (_get_registry(m) or {})]
    assert wrapped == ["blocks.0", "blocks.1", "blocks.2"]


@pytest.mark.slow
def test_checkpointed_blocks_compose_with_compile(tmp_path):
    want = run(tmp_path, "compiled", compile=True)
    got = run(tmp_path, "compiled-checkpointed", compile=True, activation_checkpointing=["Block"])
    assert int(got["model"]["blocks.0.norm.num_batches_tracked"]) == 12
    for k, v in want["model"].items():
        torch.testing.assert_close(got["model"][k], v, rtol=1e-4, atol=1e-5, msg=k)
