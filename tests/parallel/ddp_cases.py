"""Cases run under torchrun by test_ddp_paths.py, several per launch (a launch costs seconds).

`python ddp_cases.py CASES_JSON` runs each case (a dict of `Case` keyword arguments plus
"cfg") in order, in one process group, and writes for each rank and case
<run_dir>/result_rank<R>.pt: final parameters and buffers, step, validation steps,
checkpoint callbacks, the sample ids trained on, and the SaferunError raised, if any.
A case that fails must fail on every rank at the same point, or the launch hangs; a
case with block_at (a collective timeout) must come last.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

import saferun
from saferun.data import ShardedStream, shard_index

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from toys import make_classification  # noqa: E402


class Tracker(nn.Module):
    """Passes its input through; in training keeps a running mean of it (which differs
    between ranks, as BatchNorm's does) and counts training forwards."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.mean.mul_(0.5).add_(0.5 * x.detach().mean(0))
            self.calls += 1
        return x


class Tower(nn.Module):
    def __init__(self, aux: bool = False) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), Tracker(16))
        self.head = nn.Linear(16, 3)
        self.aux = nn.Linear(16, 1) if aux else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


class Numbered(IterableDataset):
    """(x, y, id) for ids 0..n-1 in order; with `presplit`, only this reader's ids, and
    `extra` more on rank 0 (uneven shards)."""

    def __init__(self, n: int = 256, presplit: bool = False, extra: int = 0) -> None:
        self.x, self.y = make_classification(n)
        self.presplit, self.extra = presplit, extra

    def __iter__(self):
        ids = range(len(self.x))
        if self.presplit:
            index, count = shard_index()
            ids = range(index, len(self.x) - (0 if index == 0 else self.extra), count)
        for i in ids:
            yield self.x[i], self.y[i], i


def loss_of(m: nn.Module, path: str, x: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
    if path == "model" or (path == "switch" and step < 2):
        return F.cross_entropy(m(x), y)
    if path == "mixed":
        return F.cross_entropy(m(x), y) + m.aux(m.backbone(0.5 * x)).pow(2).mean()
    return F.cross_entropy(m.head(m.backbone(x)), y)


class Case(saferun.Trainer):
    """path: how training_step reaches the model: "model" (self.model(x)), "submodules"
    (head(backbone(x))), "mixed" (self.model(x) plus aux(backbone(x2))), or "switch"
    (self.model(x) for two steps, then submodules). stream: None, "raw", "sharded",
    "presplit" (uneven shards). loader: None (saferun's), or a user-built DataLoader
    ordered by a "random" sampler or a "distributed" one."""

    def __init__(self, cfg: Any, path: str = "model", aux: bool = False,
                 stream: Optional[str] = None, controls: Sequence[dict] = (),
                 block_at: int = -1, loader: Optional[str] = None, impure_on: int = -1,
                 **kw: Any) -> None:
        decide = [Decide(**c) for c in controls] or [Decide(-1, "", -1)]
        super().__init__(cfg, callbacks=decide, **kw)
        self.decide = decide[0]  # every Decide sees the same events
        self.path, self.aux, self.stream, self.block_at = path, aux, stream, block_at
        self.loader, self.impure_on = loader, impure_on  # impure_on: that rank's eval mutates
        self.ids: list[int] = []

    def build_model(self) -> nn.Module:
        return Tower(self.aux)

    def build_datasets(self):
        val = TensorDataset(*make_classification(64, seed=1))
        if self.stream == "raw":
            return Numbered(), val
        if self.stream == "sharded":
            return ShardedStream(Numbered(250)), val
        if self.stream == "presplit":
            return ShardedStream(Numbered(256, presplit=True, extra=64), presplit=True), val
        return TensorDataset(*make_classification(256)), val

    def build_dataloaders(self, train, val):
        if self.loader is None:
            return super().build_dataloaders(train, val)
        bs = self.cfg.trainer.batch_size
        if self.loader == "random":
            return DataLoader(train, batch_size=bs, shuffle=True), DataLoader(val, batch_size=bs)
        sampler = DistributedSampler(train, shuffle=False)
        return DataLoader(train, batch_size=bs, sampler=sampler), DataLoader(val, batch_size=bs)

    def training_step(self, batch: Any) -> torch.Tensor:
        if self.state.step + 1 == self.block_at and self.ranks.rank == 1:
            # a receive rank 0 never sends, while rank 0 waits in the gradient all-reduce
            torch.distributed.recv(torch.zeros(1), src=0)
        if self.stream:
            x, y, ids = batch
            self.ids += ids.tolist()
        else:
            x, y = batch
        return loss_of(self.model, self.path, x, y, self.state.step)

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        x, y = batch
        if self.ranks.rank == self.impure_on:
            self.model.backbone[2].calls += 1  # evaluation that changes a buffer, on one rank
        return {"loss": F.cross_entropy(self.model(x), y)}


class Decide(saferun.Callback):
    """Returns a Control on one rank (rank, event "step", "log" or "validation", at step,
    stop/save/evaluate); records the steps that validated and saved."""

    def __init__(self, rank: int, event: str, at: int, **asks: bool) -> None:
        self.rank, self.event, self.at, self.asks = rank, event, at, asks
        self.validated: list[int] = []
        self.val_metrics: list[dict[str, float]] = []
        self.saved: list[int] = []

    def _ask(self, view: saferun.TrainerView, event: str) -> Optional[saferun.Control]:
        if event == self.event and view.rank == self.rank and view.step == self.at:
            return saferun.Control(**self.asks)
        return None

    def on_train_step_end(self, view, output):
        return self._ask(view, "step")

    def on_log(self, view, metrics):
        return self._ask(view, "log")

    def on_validation_end(self, view, metrics):
        self.validated.append(view.step)
        self.val_metrics.append(dict(metrics))
        return self._ask(view, "validation")

    def on_checkpoint(self, view, path):
        self.saved.append(view.step)


class StopLogger(saferun.Callback):
    """A logger (so on rank 0 only) that asks to stop at a log point."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_log(self, view, metrics):
        return saferun.Control(stop=view.step == self.at)


def run(case: Mapping[str, Any]) -> None:
    kw = dict(case)
    cfg = kw.pop("cfg")
    trainer = Case(cfg, **kw)
    error = None
    try:
        trainer.fit()
    except saferun.SaferunError as e:
        error = str(e)
    except RuntimeError as e:  # a collective timed out: the process group is unusable now
        if trainer.block_at < 0:
            raise
        error = str(e)
    decide = trainer.decide
    result = {"state": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
              "step": trainer.state.step, "error": error, "ids": trainer.ids,
              "validated": decide.validated, "val_metrics": decide.val_metrics,
              "saved": decide.saved}
    os.makedirs(cfg["trainer"]["run_dir"], exist_ok=True)
    torch.save(result, os.path.join(cfg["trainer"]["run_dir"],
                                    f"result_rank{trainer.ranks.rank}.pt"))


if __name__ == "__main__":
    torch.set_num_threads(1)
    for case in json.loads(sys.argv[1]):
        run(case)
    from saferun.distributed import end_process

    end_process()  # before interpreter teardown, where gloo can abort a rank
