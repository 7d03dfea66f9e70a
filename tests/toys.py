"""Small Trainer subclasses and datasets shared by the tests (importable by spawn workers)."""

from __future__ import annotations

import os
import random
import signal
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import saferun
from helpers import cpu_grad_scaler

TOYS_PATH = os.path.abspath(__file__)


def make_classification(n: int = 256, dim: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return x, y


class Net(nn.Module):
    """MLP with a BatchNorm and a Dropout, so modes matter."""

    def __init__(self, dim: int = 8, hidden: int = 16, classes: int = 3) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(dim, hidden), nn.BatchNorm1d(hidden), nn.ReLU())
        self.dropout = nn.Dropout(0.2)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.dropout(self.backbone(x)))


class ToyTrainer(saferun.Trainer):
    """Classification on synthetic data; subclasses plant bugs by overriding one hook."""

    n_train = 256
    n_val = 64

    def build_model(self) -> nn.Module:
        return Net()

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        x, y = make_classification(self.n_train + self.n_val)
        return (TensorDataset(x[: self.n_train], y[: self.n_train]),
                TensorDataset(x[self.n_train:], y[self.n_train:]))

    def training_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        x, y = batch
        logits = self.model(x)
        for metric in self.metrics.values():  # the config's `metrics` nodes, if any
            metric.update(logits, y)
        return {"loss": F.cross_entropy(logits, y), "acc": (logits.argmax(1) == y).float().mean()}


class ScaledOnCpu(ToyTrainer):
    """fp16's loss scaling with a real, enabled GradScaler on the CPU (fp16 autocast itself
    needs CUDA; the scaler's part of the step is the same), so that unscaling before clipping
    and the scaler's checkpoint state are tested without a GPU."""

    def setup(self) -> None:
        with cpu_grad_scaler(init_scale=2.0**10, growth_interval=2):
            super().setup()


# stateful validation metrics as config nodes (ToyTrainer.validation_step updates them)
METRICS = {"f1": {"_target_": "torchmetrics.classification.MulticlassF1Score", "num_classes": 3,
                  "average": "macro", "validate_args": False},
           "auroc": {"_target_": "torchmetrics.classification.MulticlassAUROC", "num_classes": 3,
                     "validate_args": False}}
TENSORBOARD = {"tensorboard": {"_target_": "saferun.loggers.TensorBoardLogger"}}


def toy_config(tmp_path: Any, tensorboard: bool = False, **trainer: Any) -> dict[str, Any]:
    """A fast config writing into tmp_path; keyword arguments override trainer keys."""
    base = dict(max_steps=20, batch_size=32, log_every_n_steps=10, run_dir=str(tmp_path / "run"),
                progress_bar=False)
    base.update(trainer)
    return {"trainer": base, "optim": {"_target_": "torch.optim.SGD", "lr": 0.05},
            "logger": TENSORBOARD if tensorboard else {}}


class AugmentedDataset(Dataset):
    """Adds noise drawn from Python's random, NumPy's global RNG and torch to every sample."""

    def __init__(self, n: int = 128, dim: int = 8) -> None:
        self.x, self.y = make_classification(n, dim)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = random.random() + float(np.random.rand()) + torch.rand(self.x.shape[1])
        return self.x[i] + 0.1 * noise, self.y[i]


class AugmentedTrainer(ToyTrainer):
    def build_datasets(self) -> tuple[Dataset, None]:
        return AugmentedDataset(), None


class DrawsDataset(Dataset):
    """Returns the worker's random draws, to see that workers and epochs differ."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        info = torch.utils.data.get_worker_info()
        wid = -1 if info is None else info.id
        return torch.tensor([wid, random.random(), float(np.random.rand()), torch.rand(()).item()],
                            dtype=torch.float64)


def weights(trainer: saferun.Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


class SelfSignalling(AugmentedTrainer):
    """Plants events at a chosen step, on a chosen rank: a real signal (in training or during
    validation), an exception, a NaN loss, or a frozen module made trainable. Used by the
    subprocess and torchrun tests."""

    def __init__(self, cfg: Any, signal_at: int = -1, signum: int = 0, in_validation: bool = False,
                 on_rank: int = -1, fail_at: int = -1, nan_at: int = -1, plain: bool = False,
                 spike_at: int = -1, hold_at: int = -1, val_size: int = 64, unfreeze_at: int = -1,
                 **kw: Any) -> None:
        super().__init__(cfg, **kw)
        self.unfreeze_at = unfreeze_at
        self.signal_at, self.signum, self.in_validation = signal_at, signum, in_validation
        self.on_rank, self.fail_at, self.nan_at, self.plain = on_rank, fail_at, nan_at, plain
        self.spike_at, self.hold_at, self.val_size = spike_at, hold_at, val_size

    def build_model(self) -> nn.Module:
        if self.plain:  # no BatchNorm or Dropout: results do not depend on the per-rank batch
            return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        return super().build_model()

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        x, y = make_classification(self.val_size, seed=1)
        if self.plain:
            return TensorDataset(*make_classification(256)), TensorDataset(x, y)
        return AugmentedDataset(), TensorDataset(x, y)

    def _planted(self, at: int) -> bool:
        return self.state.step + 1 == at and self.on_rank in (-1, self.ranks.rank)

    def training_step(self, batch: Any) -> torch.Tensor:
        if not self.in_validation and self._planted(self.signal_at):
            os.kill(os.getpid(), self.signum)
        if self._planted(self.hold_at):
            hold(self.state.run_dir)
        if self._planted(self.fail_at):
            raise RuntimeError(f"planted failure on rank {self.ranks.rank}")
        if self._planted(self.unfreeze_at):  # every parameter trainable again, on this rank alone
            for p in self.model.parameters():
                p.requires_grad_(True)
        loss = super().training_step(batch)
        if self._planted(self.spike_at):
            return loss * 1000
        # A NaN added to the loss leaves the gradients finite: the NaN stays on this rank.
        return loss + float("nan") if self._planted(self.nan_at) else loss

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        if self.in_validation and self.state.step == self.signal_at and \
                self.on_rank in (-1, self.ranks.rank):
            os.kill(os.getpid(), self.signum)
        return super().validation_step(batch)


def hold(run_dir: str) -> None:
    """Mid-step: write <run_dir>/holding, wait for the test to create <run_dir>/release
    (after it has sent its signals), then until those signals have had their effect on this
    process's children (a DataLoader worker's death), so that it lands mid-step."""
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "holding"), "w"):
        pass
    release = os.path.join(run_dir, "release")
    for _ in range(6000):  # at most two minutes
        if os.path.exists(release):
            break
        time.sleep(0.02)
    deadline = time.monotonic() + 120
    while not stop_signals_landed() and time.monotonic() < deadline:
        time.sleep(0.01)


_STOP_MASK = (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1))


def stop_signals_landed() -> bool:
    """Whether a SIGINT or SIGTERM sent to the process group is done with every child process
    of this one: each child has exited, or holds no such signal pending that it does not block
    (saferun's workers block them). Reads Linux's /proc; elsewhere, waits half a second."""
    if not os.path.isdir("/proc/self/task"):
        time.sleep(0.5)
        return True
    children: set[str] = set()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                children.update(f.read().split())
        except OSError:  # the thread ended
            continue
    for pid in children:
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
        except OSError:  # exited and reaped
            continue
        if fields["State"].strip().startswith(("Z", "X")):  # exited: SIGCHLD is on its way here
            continue
        pending = (int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)) & _STOP_MASK
        if pending & ~int(fields["SigBlk"], 16):
            return False
    return True


def main() -> None:
    """`python tests/toys.py CONFIG_JSON [PLANT_JSON]` (or under torchrun): train, save weights.

    PLANT_JSON holds SelfSignalling's keyword arguments. Each rank writes its final weights
    to <run_dir>/final_weights_rank<R>.pt, its final metrics to final_metrics_rank<R>.json and its
    weight average (trainer.ema, if on) to final_ema_rank<R>.pt (each rank's spike detectors are
    in the run's last checkpoint, per_rank[R]["spikes"]).
    """
    import json
    import sys

    cfg = json.loads(sys.argv[1])
    plant = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    trainer = SelfSignalling(cfg, **plant)
    trainer.fit()
    torch.save(weights(trainer), os.path.join(cfg["trainer"]["run_dir"],
                                              f"final_weights_rank{trainer.ranks.rank}.pt"))
    if trainer.ema is not None:
        torch.save(trainer.ema.state_dict(), os.path.join(cfg["trainer"]["run_dir"],
                                                           f"final_ema_rank{trainer.ranks.rank}.pt"))
    with open(os.path.join(cfg["trainer"]["run_dir"], f"final_metrics_rank{trainer.ranks.rank}.json"),
              "w") as f:
        json.dump(trainer.state.metrics, f)


if __name__ == "__main__":
    main()
    from saferun.distributed import end_process

    end_process()  # before interpreter teardown, where gloo can abort a rank
