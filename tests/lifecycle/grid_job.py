"""The lifecycle grid's one job: a tiny classifier with every stateful component switched on.

`python grid_job.py CONFIG_JSON [PLANT_JSON]` (or under torchrun) trains it; PLANT_JSON holds
GridJob's keyword arguments (where it kills itself or plants a NaN).
"""

from __future__ import annotations

import copy
import json
import os
import signal
import sys
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from toys import ToyTrainer, make_classification  # noqa: E402

JOB_PATH = os.path.abspath(__file__)
MAX_STEPS = 12  # logged every 2 steps, validated every 3 (saving the best), saved every 4
LOG_EVERY = 2
PLATEAU = {"_target_": "torch.optim.lr_scheduler.ReduceLROnPlateau", "factor": 0.5, "patience": 0}
COSINE = {"_target_": "saferun.schedules.warmup_cosine", "warmup_steps": 2,
          "total_steps": "${trainer.max_steps}", "min_lr_ratio": 0.1}  # sized by the run's length


def config(run_dir: Any, *, sched: str = "cosine", trackers: bool = True, ranks: int = 1,
           **trainer: Any) -> dict[str, Any]:
    """Every component on: metrics.jsonl, TensorBoard, MLflow (the default SQLite store beside
    the run directory), W&B offline, save_best, EarlyStopping, trainer.ema, the spike guard and
    a schedule (cosine: length-dependent; plateau: ReduceLROnPlateau on val/loss)."""
    t = dict(max_steps=MAX_STEPS, batch_size=32 // ranks, shuffle=False, log_every_n_steps=LOG_EVERY,
             val_every_n_steps=3, save_every_n_steps=4, run_dir=str(run_dir), progress_bar=False,
             save_best="val/loss", save_best_mode="min", ema={"decay": 0.9})
    if sched == "plateau":
        t["sched_metric"] = "val/loss"
    t.update(trainer)
    logger: dict[str, Any] = {"tensorboard": {"_target_": "saferun.loggers.TensorBoardLogger"},
                              "jsonl": {"_target_": "saferun.loggers.MetricsJsonl"}}
    if trackers:
        logger.update(mlflow={"experiment": "grid"}, wandb={"project": "grid"})
    # the spike guard compares every step (raise, checked at log points and saves) with a
    # window of 6 and a limit far above any loss here: its detectors' state evolves from step 2
    # on, and nothing is flagged
    guards = {"spikes": "raise", "spike_window": 6, "spike_warmup": 2, "spike_threshold": 1e6}
    return {"name": "grid", "trainer": t, "guards": guards,
            "optim": {"_target_": "torch.optim.SGD", "lr": 0.2, "momentum": 0.9},
            "sched": copy.deepcopy(PLATEAU if sched == "plateau" else COSINE),
            "callbacks": {"early": {"_target_": "saferun.stopping.EarlyStopping",
                                    "monitor": "val/loss", "mode": "min", "patience": 5}},
            "logger": logger}


class GridJob(ToyTrainer):
    """No BatchNorm or Dropout (two ranks over halves of a batch equal one process), shuffle
    off; logs an image, texts and histograms, several of one name per log point as users do."""

    def __init__(self, cfg: Any, kill_at: int = -1, kill_in_validation_at: int = -1,
                 term_at: int = -1, nan_at: int = -1, corrupt_at: int = -1, **kw: Any) -> None:
        super().__init__(cfg, **kw)
        self.kill_at, self.kill_in_validation_at = kill_at, kill_in_validation_at
        self.term_at, self.nan_at, self.corrupt_at = term_at, nan_at, corrupt_at

    def build_model(self) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        x, y = make_classification(256 + 64)
        return TensorDataset(x[:256], y[:256]), TensorDataset(x[256:], y[256:])

    def training_step(self, batch: Any) -> torch.Tensor:
        step = self.state.step + 1
        if step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == self.term_at:
            self.term_at = -1  # once: the resumed run passes this step again
            os.kill(os.getpid(), signal.SIGTERM)  # the handler saferun installed
        if step % 3 == 0:
            self.log_image("grid", torch.full((1, 4, 4), step / 20))
        if step % 3 != 1:  # texts and histograms of one name, two in some log windows
            self.log_text("note", f"training step {step}")
            self.log_histogram("weights", list(self.model.parameters())[-2])  # the head
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        if step == self.corrupt_at:  # the head's bias goes infinite in this step's update,
            # its loss and gradients finite (the bias's gradient does not read the bias)
            self.corrupt_at = -1
            list(self.model.parameters())[-1].data.fill_(float("inf"))
        if step == self.nan_at:
            self.nan_at = -1  # once: a rollback passes this step again
            return loss + float("nan")
        return loss

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        if self.state.step == self.kill_in_validation_at:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch
        logits = self.model(x)
        self.log_histogram("logits", logits)  # one per validation batch
        return {"loss": F.cross_entropy(logits, y), "acc": (logits.argmax(1) == y).float().mean()}


def main() -> None:
    os.environ.setdefault("WANDB_SILENT", "true")
    torch.set_num_threads(1)
    cfg = json.loads(sys.argv[1])
    plant: dict[str, Any] = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    GridJob(cfg, **plant).fit()


def run_in_process(cfg: dict[str, Any], second_max_steps: Optional[int] = None,
                   **plant: Any) -> GridJob:
    job = GridJob(cfg, **plant)
    job.fit()
    if second_max_steps is not None:
        job.cfg.trainer.max_steps = second_max_steps
        job.fit()
    return job


if __name__ == "__main__":
    main()
    from saferun.distributed import end_process

    end_process()  # before interpreter teardown, where gloo can abort a rank
