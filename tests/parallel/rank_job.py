"""A job that records, on each rank, what saferun promises under torchrun (docs/distributed.md).

`python -m torch.distributed.run --nproc_per_node=2 rank_job.py CONFIG_JSON CONFIG_JSON` trains
it twice in one process group: the first config with a parameter the loss never uses
(find_unused_parameters: saferun averages the gradients), the second without (the steps after
the first go through DistributedDataParallel). Each rank then writes what it saw to
<run_dir>/record_rank<R>.json (read by test_rank_guarantees.py): the sample ids and a random
draw of every micro-batch, the gradient all-reduces counted so far at each micro-batch (calls
of torch.distributed.all_reduce, and DDP's through a counting comm hook), and the metrics
every callback received.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import TensorDataset

import saferun

N_TRAIN, N_VAL = 24, 5  # 5: an even split across 2 ranks would have to pad one sample
ALLREDUCES = [0]
_all_reduce = dist.all_reduce


def counting_all_reduce(*args: Any, **kwargs: Any) -> Any:
    """torch.distributed.all_reduce, counted (a spy: the real collective runs)."""
    ALLREDUCES[0] += 1
    return _all_reduce(*args, **kwargs)


def counting_allreduce_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP reads annotations
    ALLREDUCES[0] += 1
    return default_hooks.allreduce_hook(None, bucket)


def samples(n: int) -> TensorDataset:
    ids = torch.arange(n, dtype=torch.float32)
    return TensorDataset(torch.stack([ids / n, ids % 3], dim=1), ids)


class Model(nn.Module):
    def __init__(self, unused: bool) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(2, 8), nn.Dropout(0.5), nn.Linear(8, 1))
        if unused:  # never in the loss: needs find_unused_parameters
            self.unused = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).squeeze(1)


class Record(saferun.Callback):
    def __init__(self) -> None:
        self.logs: list[dict[str, float]] = []
        self.vals: list[dict[str, float]] = []
        self.losses: list[float] = []  # this rank's own loss at each step

    def on_train_step_end(self, view, output):  # type: ignore[no-untyped-def]
        self.losses.append(output.loss.item())

    def on_log(self, view, metrics):  # type: ignore[no-untyped-def]
        self.logs.append({k: v for k, v in metrics.items() if not k.startswith("perf/")})

    def on_validation_end(self, view, metrics):  # type: ignore[no-untyped-def]
        self.vals.append(dict(metrics))


class RankJob(saferun.Trainer):
    def build_model(self) -> nn.Module:
        return Model(unused=self.cfg.trainer.find_unused_parameters)

    def build_datasets(self) -> tuple[TensorDataset, TensorDataset]:
        return samples(N_TRAIN), samples(N_VAL)

    def setup(self) -> None:
        if self._is_setup:
            return
        super().setup()
        self.micro: list[Any] = []
        sync = getattr(self._strategy, "_sync", None)  # GradientSync, under torchrun
        if sync is not None:  # DDP's own all-reduces, once training goes through it
            sync.ddp.register_comm_hook(None, counting_allreduce_hook)

    def training_step(self, batch: Any) -> dict[str, torch.Tensor]:
        x, ids = batch
        self.micro.append({"step": self.state.step + 1, "epoch": self.state.epoch,
                           "ids": ids.int().tolist(), "allreduces": ALLREDUCES[0],
                           "draw": torch.rand(()).item()})
        loss = (self.model(x) - ids / N_TRAIN).pow(2).mean()
        rank = self.ranks.rank  # and a value only this rank logs (a rank-dependent branch)
        return {"loss": loss, "rank": torch.tensor(float(rank)),
                f"only_rank{rank}": torch.tensor(10.0 + rank)}

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        _, ids = batch
        return {"id_squared": (ids**2).mean(), "rank": torch.tensor(float(self.ranks.rank))}


def main() -> None:
    dist.all_reduce = counting_all_reduce
    for arg in sys.argv[1:]:
        cfg = json.loads(arg)
        record = Record()
        trainer = RankJob(cfg, callbacks=[record])
        trainer.fit()
        out = {"micro": trainer.micro, "logs": record.logs, "vals": record.vals,
               "losses": record.losses}
        path = os.path.join(cfg["trainer"]["run_dir"], f"record_rank{trainer.ranks.rank}.json")
        with open(path, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
    from saferun.distributed import end_process

    end_process()  # before interpreter teardown, where gloo can abort a rank
