"""`torchrun ... fsdp_job.py CONFIG_JSON [PLANT_JSON]`: train a small stack of blocks with the
configured strategy (fsdp or ddp), then write each rank's view of the result into run_dir:

- `optim_rank<R>.pt`: this rank's optimizer state, its own shards (the local tensors);
- `bytes_rank<R>.json`: the bytes of parameters and optimizer state this rank holds, and the
  whole model's parameter bytes;
- `run_rank<R>.json`: the final metrics, and the reduce-scatters this rank ran;
- `buffers_rank<R>.pt`: this rank's buffers (BatchNorm statistics);
- (`model.pt`, rank 0, is saferun's own export: the whole weights.)

PLANT_JSON holds SelfSignalling's keyword arguments (tests/toys.py), plus `submodules: true`
for a training_step that calls the model's submodules instead of the model, and
`val_samples` (64) for the validation set's size, and `die_in_save: true` for rank 1 to die
while it writes its first checkpoint's shards, and `overflow_at: N` for rank 1's update at step
N to leave an Inf in its shard of the first parameter (the loss and gradients stay finite),
and `trajectory: true` for rank 0 to write the whole weights after each step (ema_trajectory.py).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from toys import AugmentedDataset, SelfSignalling, make_classification  # noqa: E402

from ema_trajectory import Trajectory  # noqa: E402


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.fc(self.norm(x)))


class Stack(nn.Module):
    """Blocks (FSDP's default units) between an input layer and a head; a BatchNorm (buffers)
    and a Dropout (modes); odd sizes, so that the shards are uneven."""

    def __init__(self, dim: int = 8, width: int = 30, layers: int = 3, classes: int = 3,
                 batchnorm: bool = True) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.bn = nn.BatchNorm1d(width) if batchnorm else nn.Identity()
        self.dropout = nn.Dropout(0.1)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.dropout(self.bn(x)))


class StackTrainer(SelfSignalling):
    def __init__(self, cfg: Any, submodules: bool = False, batchnorm: bool = True,
                 val_samples: int = 64, **plant: Any) -> None:
        super().__init__(cfg, **plant)
        self.submodules, self.batchnorm, self.val_samples = submodules, batchnorm, val_samples

    def build_model(self) -> nn.Module:
        return Stack(batchnorm=self.batchnorm)

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        x, y = make_classification(self.val_samples, seed=1)
        return AugmentedDataset(), TensorDataset(x, y)

    def training_step(self, batch: Any) -> torch.Tensor:
        if self.submodules:
            x, y = batch
            return F.cross_entropy(self.model.head(self.model.inp(x)), y)
        return super().training_step(batch)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def nbytes(tensors: Any) -> int:
    return sum(local(t).numel() * local(t).element_size() for t in tensors)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    plant = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    if plant.pop("die_in_save", False) and os.environ.get("RANK") == "1":  # killed mid-save
        from torch.distributed.checkpoint import FileSystemWriter

        FileSystemWriter.write_data = lambda *a, **kw: os._exit(9)  # type: ignore[method-assign]
    overflow_at = plant.pop("overflow_at", None)
    trajectory = Trajectory() if plant.pop("trajectory", False) else None
    trainer = StackTrainer(cfg, callbacks=[trajectory] if trajectory else [], **plant)
    if trajectory is not None:
        trajectory.trainer = trainer
    if overflow_at is not None:
        trainer.setup()  # the optimizer, to hook

        def overflow(optimizer: Any, *_: Any) -> None:
            if trainer.state.step + 1 == overflow_at and trainer.ranks.rank == 1:
                with torch.no_grad():
                    local(optimizer.param_groups[0]["params"][0]).view(-1)[0] = float("inf")

        trainer.optimizer.register_step_post_hook(overflow)
    calls = [0]
    reduce_scatter = torch.distributed.reduce_scatter_single  # FSDP2 looks it up at each call

    def counted(*args: Any, **kw: Any) -> Any:
        calls[0] += 1
        return reduce_scatter(*args, **kw)

    torch.distributed.reduce_scatter_single = counted
    trainer.fit()
    rank, run_dir = trainer.ranks.rank, cfg["trainer"]["run_dir"]
    opt = trainer.optimizer
    states = [v for s in opt.state.values() for v in s.values()
              if isinstance(v, torch.Tensor) and v.ndim > 0]
    torch.save({f"{i}.{k}": local(v).clone() for i, s in enumerate(opt.state.values())
                for k, v in s.items() if isinstance(v, torch.Tensor)},
               os.path.join(run_dir, f"optim_rank{rank}.pt"))
    torch.save({k: v.clone() for k, v in trainer.model.named_buffers()},
               os.path.join(run_dir, f"buffers_rank{rank}.pt"))
    with open(os.path.join(run_dir, f"run_rank{rank}.json"), "w") as f:
        json.dump({"metrics": trainer.state.metrics, "reduce_scatters": calls[0]}, f)
    params = list(trainer.model.parameters())
    with open(os.path.join(run_dir, f"bytes_rank{rank}.json"), "w") as f:
        json.dump({"params": nbytes(params), "optim": nbytes(states),
                   "trainable": nbytes(p for p in params if p.requires_grad),
                   "whole": sum(p.numel() * p.element_size() for p in params)}, f)


if __name__ == "__main__":
    main()
    from saferun.distributed import end_process

    end_process()  # before interpreter teardown, where gloo can abort a rank
