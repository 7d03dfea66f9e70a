"""(c) PyTorch Lightning: the same job as a LightningModule, with equivalent Trainer settings.

Lightning's defaults are kept except where they would make it do different work:
no sanity-check validation, progress bar or model summary (saferun and the hand-written loop
do none of these in a non-interactive run), and checkpoints on the job's step interval
rather than at every epoch's end. Its default logger writes TensorBoard events, as the other
two do. It logs the step's loss at each log point
(Lightning's idiom) where the other two log the mean since the last log point.
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from common import Job, StepClock, build_datasets, build_model, epoch_seed


class BenchModule(L.LightningModule):
    def __init__(self, job: Job, clock: StepClock) -> None:
        super().__init__()
        self.job = job
        self.clock = clock
        self.model = build_model(job.workload)
        self.train_set, self.val_set = build_datasets(job.workload)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self.model(x)
        self.log_dict({"val/loss": F.cross_entropy(logits, y),
                       "val/acc": (logits.argmax(1) == y).float().mean()}, batch_size=len(y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.job.lr)

    def train_dataloader(self) -> DataLoader:
        # Lightning creates epoch 0's iterator before on_train_epoch_start, so seed it here.
        generator = torch.Generator().manual_seed(epoch_seed(self.job.seed, 0))
        return DataLoader(self.train_set, batch_size=self.job.batch_size, shuffle=True,
                          generator=generator, pin_memory=self.job.device == "cuda")

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.job.batch_size,
                          pin_memory=self.job.device == "cuda")

    def on_train_epoch_start(self) -> None:
        # Later epochs' iterators are created after this hook: give each its own order.
        if self.current_epoch > 0:
            loader = self.trainer.train_dataloader
            loader.generator.manual_seed(epoch_seed(self.job.seed, self.current_epoch))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.clock.tick()


def train(job: Job, clock: StepClock) -> dict[str, torch.Tensor]:
    torch.manual_seed(job.seed)
    module = BenchModule(job, clock)
    trainer = L.Trainer(
        accelerator="gpu" if job.device == "cuda" else "cpu", devices=1,
        precision="bf16-mixed" if job.precision == "bf16" else "32-true",
        max_steps=job.steps, max_epochs=-1,
        val_check_interval=job.val_every, check_val_every_n_epoch=None,
        log_every_n_steps=job.log_every,
        gradient_clip_val=job.max_grad_norm, gradient_clip_algorithm="norm",
        default_root_dir=os.path.join(job.run_dir, "lightning"),
        callbacks=[ModelCheckpoint(every_n_train_steps=job.save_every)],
        num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module)
    return {k: trainer.callback_metrics[k] for k in ("val/loss", "val/acc")}  # 0-dim tensors
