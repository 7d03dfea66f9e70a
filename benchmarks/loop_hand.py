"""(a) The reference: a training loop written by hand, following current best practice.

- gradients are set to None, not zeroed (`zero_grad(set_to_none=True)`);
- the loss and gradient norm are summed on the device, and read to the host once per log
  interval, in one sync;
- the gradient norm is clipped;
- evaluation runs in eval mode under `torch.inference_mode()`;
- checkpoints hold the whole training state and are written atomically;
- on CUDA: bf16 autocast, pinned host memory and non_blocking copies.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.tensorboard import SummaryWriter

from common import Job, StepClock, build_datasets, build_model, epoch_seed


def train(job: Job, clock: StepClock) -> dict[str, float]:
    device = torch.device(job.device)
    cuda = device.type == "cuda"
    torch.manual_seed(job.seed)
    model = build_model(job.workload).to(device)
    train_set, val_set = build_datasets(job.workload)
    train_loader = DataLoader(train_set, batch_size=job.batch_size, shuffle=True,
                              generator=torch.Generator(), pin_memory=cuda)
    val_loader = DataLoader(val_set, batch_size=job.batch_size, pin_memory=cuda)
    opt = torch.optim.AdamW(model.parameters(), lr=job.lr)
    autocast: Callable[[], ContextManager] = (
        functools.partial(torch.autocast, "cuda", dtype=torch.bfloat16) if cuda
        else contextlib.nullcontext)
    writer = SummaryWriter(os.path.join(job.run_dir, "tensorboard"))
    # Running sums stay on the device: adding to them never waits for the device.
    loss_sum = torch.zeros((), device=device)
    norm_sum = torch.zeros((), device=device)
    metrics: dict[str, float] = {}
    step, epoch = 0, 0
    model.train()
    while step < job.steps:
        train_loader.generator.manual_seed(epoch_seed(job.seed, epoch))  # this epoch's order
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast():
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            norm_sum += nn.utils.clip_grad_norm_(model.parameters(), job.max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss_sum += loss.detach()
            step += 1
            clock.tick()
            if step % job.log_every == 0:
                loss_mean, norm_mean = (torch.stack([loss_sum, norm_sum]) / job.log_every).tolist()
                loss_sum.zero_()
                norm_sum.zero_()
                writer.add_scalar("train/loss", loss_mean, step)
                writer.add_scalar("train/grad_norm", norm_mean, step)
                print(f"step {step} | train/loss {loss_mean:.4g} | train/grad_norm {norm_mean:.4g}")
            if step % job.val_every == 0:
                metrics = validate(model, val_loader, device, autocast)
                for name, value in metrics.items():
                    writer.add_scalar(name, value, step)
                print(f"step {step} | " + " | ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
            if step % job.save_every == 0 or step == job.steps:
                save_checkpoint(os.path.join(job.run_dir, "checkpoint.pt"), model, opt, step)
            if step == job.steps:
                break
        epoch += 1
    writer.close()
    return metrics


def save_checkpoint(path: str, model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    """Model, optimizer, step and RNG, written beside `path` and renamed: never half-written."""
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
             "rng": torch.get_rng_state()}
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def validate(model: nn.Module, loader: DataLoader, device: torch.device,
             autocast: Callable[[], ContextManager]) -> dict[str, float]:
    """Mean loss and accuracy over `loader`, weighted by batch size, read in one sync."""
    model.eval()
    with torch.inference_mode(), autocast():
        sums = torch.zeros(2, device=device)
        count = 0
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            acc = (logits.argmax(1) == y).float().mean()
            sums += torch.stack([F.cross_entropy(logits, y), acc]).float() * len(y)
            count += len(y)
    model.train()  # nothing is frozen here, so putting every module back in train mode is right
    loss, acc = (sums / count).tolist()
    return {"val/loss": loss, "val/acc": acc}
