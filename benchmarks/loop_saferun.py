"""(b) saferun: the same job as a `saferun.Trainer` subclass, with saferun's default settings.

The config sets only what defines the job (steps, batch size, schedules, optimizer, device);
everything else, guards, checkpoints, TensorBoard logging and log lines included, is saferun's
default (its default log, clipping and checkpoint intervals are also the job's).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import saferun
from common import Job, StepClock, build_datasets, build_model


class Tick(saferun.Callback):
    """Marks the end of each optimizer step for the benchmark's clock."""

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def on_train_step_end(self, view: saferun.TrainerView, output: saferun.StepOutput
                          ) -> Optional[saferun.Control]:
        self.clock.tick()
        return None


class BenchTrainer(saferun.Trainer):
    workload = "mlp"

    def build_model(self) -> nn.Module:
        return build_model(self.workload)

    def build_datasets(self) -> tuple[Dataset, Optional[Dataset]]:
        return build_datasets(self.workload)

    def training_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        x, y = batch
        logits = self.model(x)
        return {"loss": F.cross_entropy(logits, y), "acc": (logits.argmax(1) == y).float().mean()}


def config(job: Job) -> dict[str, Any]:
    """The job as saferun config: only what defines it; guards and the rest are the defaults."""
    return {
        "trainer": {"max_steps": job.steps, "batch_size": job.batch_size,
                    "log_every_n_steps": job.log_every, "val_every_n_steps": job.val_every,
                    "max_grad_norm": job.max_grad_norm, "save_every_n_steps": job.save_every,
                    "device": job.device,
                    "precision": job.precision, "run_dir": job.run_dir},
        "optim": {"_target_": "torch.optim.AdamW", "lr": job.lr},
        "seed": job.seed,
        **({"guards": job.guards} if job.guards else {}),
    }


def train(job: Job, clock: StepClock) -> dict[str, float]:
    trainer = BenchTrainer(config(job), callbacks=[Tick(clock)])
    trainer.workload = job.workload
    metrics = trainer.fit()
    return {"val/loss": metrics["val/loss"], "val/acc": metrics["val/acc"]}
