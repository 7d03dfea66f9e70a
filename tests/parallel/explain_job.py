"""`torchrun ... explain_job.py CONFIG_JSON PLANT_JSON`: a mistake in the user's code on one
rank or on every rank, under trainer.strategy ddp or fsdp, for test_explain_ranks.py.

The model's forward takes part in a collective of its own (`Centred`: the batch mean over every
rank, as a cross-rank normalisation does) before the planted mistake, so that a replay of the
forward on the failing rank alone would wait for, or pair with, a collective of the others.

PLANT_JSON: `at` (the step), `on_rank` (-1: every rank), `where` ("train": training_step at
step `at`, "val": validation_step in the validation after step `at`), `raises` (instead of the
cut: training_step raises RuntimeError(raises), a user's own error), `loader` ("distributed"
or "random": a DataLoader built by the user, with no mistake planted). A run that ends writes
each rank's whole final parameters to <run_dir>/final_rank<R>.pt; a SaferunError (a refusal at
setup, or an explained error) is written to <run_dir>/error_rank<R>.txt before it propagates.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import saferun

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from toys import make_classification  # noqa: E402


class Centred(nn.Module):
    """In training, subtracts the batch mean over every rank: an all_reduce in forward (in one
    process, the batch's mean)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        if not dist.is_initialized():
            return x - x.detach().mean(0, keepdim=True)
        mean = x.detach().mean(0, keepdim=True)
        dist.all_reduce(mean)
        return x - mean / dist.get_world_size()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.centred = Centred()
        self.head = nn.Linear(16, 3)
        self.cut = False  # the planted mistake: drop a feature before the head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.centred(self.inp(x))
        return self.head(x[:, :-1] if self.cut else x)


class Job(saferun.Trainer):
    def __init__(self, cfg: Any, at: int = -1, on_rank: int = -1, where: str = "train",
                 loader: str = "", raises: str = "") -> None:
        super().__init__(cfg)
        self.at, self.on_rank, self.where, self.loader = at, on_rank, where, loader
        self.raises = raises

    def build_model(self) -> nn.Module:
        self.net = Net()
        return self.net

    def build_datasets(self) -> tuple[TensorDataset, TensorDataset]:
        return (TensorDataset(*make_classification(256)),
                TensorDataset(*make_classification(64, seed=1)))

    def build_dataloaders(self, train, val):  # type: ignore[no-untyped-def]
        if not self.loader:
            return super().build_dataloaders(train, val)
        bs = self.cfg.trainer.batch_size
        if self.loader == "random":
            return DataLoader(train, batch_size=bs, shuffle=True), DataLoader(val, batch_size=bs)
        sampler = DistributedSampler(train, shuffle=False)
        return DataLoader(train, batch_size=bs, sampler=sampler), DataLoader(val, batch_size=bs)

    def _planted(self, where: str, step: int) -> bool:
        return where == self.where and step == self.at and self.on_rank in (-1, self.ranks.rank)

    def training_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        self.net.cut = self._planted("train", self.state.step + 1)
        if self.net.cut and self.raises:
            raise RuntimeError(self.raises)
        return F.cross_entropy(self.model(x), y)

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        x, y = batch
        self.net.cut = self._planted("val", self.state.step)
        return {"loss": F.cross_entropy(self.model(x), y)}


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


def main() -> None:
    cfg, plant = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    job = Job(cfg, **plant)
    try:
        job.fit()
    except saferun.SaferunError as e:
        os.makedirs(cfg["trainer"]["run_dir"], exist_ok=True)
        with open(os.path.join(cfg["trainer"]["run_dir"], f"error_rank{job.ranks.rank}.txt"),
                  "w") as f:
            f.write(str(e))
        raise
    state = {k: full(v) for k, v in job.model.state_dict().items()}  # fsdp: a collective
    torch.save(state, os.path.join(cfg["trainer"]["run_dir"], f"final_rank{job.ranks.rank}.pt"))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
    from saferun.distributed import end_process

    end_process()  # before interpreter teardown, where gloo can abort a rank
