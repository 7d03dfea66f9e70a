"""Differential test: saferun against a short hand-written reference loop, on every path.

The same job (a small classifier with BatchNorm and Dropout, AdamW with weight decay, a
StepLR schedule, clipping, random augmentation) runs through saferun and through
`reference()` below, over a grid of the options that change saferun's path: accumulation
with a partial last micro-batch, drop_last, DataLoader workers, bf16, dict and dataclass
batches, a user-built DataLoader, the skip policy with a planted NaN, max_epochs,
val_every_n_steps, limit_val_batches, and a stop by SIGTERM (mid-epoch, at an epoch's end,
during validation) followed by resume=auto. Compared bitwise: the final parameters and
buffers, the optimizer and scheduler state, the step count, and the logged curves
(validation metrics and train/loss at every log point, as callbacks see them; one cell
reads the validation curve back from the TensorBoard files).

bf16 is compared bitwise too: both sides run the same ops under the same CPU autocast, so
nothing but a difference in the loop can make them differ (measured: identical).

The reference is plain PyTorch. From saferun it takes only the documented seeding contract,
importing `derive_seed` instead of copying it:
  - setup seeds Python's `random`, NumPy and torch with `seed`, then builds the model;
  - epoch e's shuffle order comes from a torch.Generator seeded with derive_seed(seed, e, rank)
    and passed to the DataLoader as its `generator` (PyTorch's own reproducibility recipe);
  - DataLoader worker w of epoch e seeds random, NumPy (mod 2**32) and torch with
    derive_seed(seed, e, w, rank);
  - validation draws nothing from training's random streams (its DataLoader draws a seed
    from torch's RNG: the reference forks it, saferun restores the RNG states afterwards).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import os
import random
import signal
from typing import Any, Optional

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, default_collate

import saferun
from saferun.preemption import Preempted
from saferun.data.seeding import derive_seed  # the documented contract, imported rather than copied

N_TRAIN, N_VAL, BATCH, DIM, CLASSES = 84, 40, 16, 8, 3  # 6 batches an epoch, the last of 4
LR, DECAY, CLIP, LOG_EVERY = 0.02, 0.1, 0.5, 4
NAN_SAMPLE = 37


# ---------------------------------------------------------------------- the job, shared

def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, DIM, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


class Samples(Dataset):
    """Tuples or dicts; training samples get noise from random, NumPy's global RNG and torch."""

    def __init__(self, n: int, seed: int, augment: bool, as_dict: bool,
                 nan_at: Optional[int] = None) -> None:
        self.x, self.y = make_data(n, seed)
        if nan_at is not None:
            self.x[nan_at, 3] = float("nan")  # a bad record
        self.augment, self.as_dict = augment, as_dict

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        x = self.x[i]
        if self.augment:
            x = x + 0.1 * (random.random() - np.random.rand() + torch.rand(DIM))
        return {"x": x, "y": self.y[i]} if self.as_dict else (x, self.y[i])


@dataclasses.dataclass
class Batch:
    """A batch class built by a collate_fn; __post_init__ converts the raw inputs once (as a
    unit conversion or normalisation would), so rebuilding the batch would convert twice."""

    x: torch.Tensor
    y: torch.Tensor

    def __post_init__(self) -> None:
        self.x = self.x / 4.0


def collate_batch(samples: list[Any]) -> Batch:
    return Batch(*default_collate(samples))


def inputs_targets(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(batch, Batch):
        return batch.x, batch.y
    if isinstance(batch, dict):
        return batch["x"], batch["y"]
    return batch[0], batch[1]


def loss_of(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = inputs_targets(batch)
    return F.cross_entropy(model(x), y)


def val_metrics(model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    x, y = inputs_targets(batch)
    logits = model(x)
    return {"loss": F.cross_entropy(logits, y), "acc": (logits.argmax(1) == y).float().mean()}


@dataclasses.dataclass(frozen=True)
class Job:
    accumulate: int = 1
    drop_last: bool = False
    workers: int = 0
    precision: str = "fp32"
    batch: str = "tuple"  # tuple, dict or dataclass (built by collate_batch: the config's
    # collate_fn, or the user loader's)
    user_loader: bool = False  # build_dataloaders returns a plain DataLoader(shuffle=True)
    skip_nan: bool = False  # guards.nonfinite=skip, and sample NAN_SAMPLE is NaN
    stop: Optional[str] = None  # SIGTERM "training" during step stop_at, or "validation" after it
    stop_at: int = 0
    max_steps: int = 15
    max_epochs: Optional[int] = None
    val_every: Optional[int] = None
    limit_val: Optional[int] = None
    tensorboard: bool = False
    seed: int = 5


def model_for(job: Job) -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2),
                         nn.Linear(16, CLASSES))


def datasets_for(job: Job) -> tuple[Samples, Samples]:
    as_dict = job.batch == "dict"
    return (Samples(N_TRAIN, 0, True, as_dict, NAN_SAMPLE if job.skip_nan else None),
            Samples(N_VAL, 1, False, as_dict))


def collate_for(job: Job) -> Any:
    return collate_batch if job.batch == "dataclass" else None


def user_loaders(job: Job, train: Dataset, val: Dataset) -> tuple[DataLoader, DataLoader]:
    """What a user builds by hand: no generator, no worker_init_fn."""
    collate = collate_for(job)
    return (DataLoader(train, batch_size=BATCH, shuffle=True, drop_last=job.drop_last,
                       num_workers=job.workers, collate_fn=collate),
            DataLoader(val, batch_size=BATCH, collate_fn=collate))


# ---------------------------------------------------------------------- the reference loop

def seed_worker(seed: int, epoch: int, worker_id: int) -> None:
    s = derive_seed(seed, epoch, worker_id, 0)
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)


def reference(job: Job) -> dict[str, Any]:
    random.seed(job.seed)
    np.random.seed(job.seed)
    torch.manual_seed(job.seed)
    model = model_for(job)
    train, val = datasets_for(job)
    user_train, user_val = user_loaders(job, train, val) if job.user_loader else (None, None)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.8)
    autocast = (functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16)
                if job.precision == "bf16" else contextlib.nullcontext)
    train_curve, val_curve, window, pending = [], [], [], 0

    def log() -> None:
        if window:
            train_curve.append((step, torch.stack(window).float().mean().item()))
        window.clear()

    def evaluate() -> None:
        model.eval()
        loader = user_val or DataLoader(val, batch_size=BATCH, collate_fn=collate_for(job))
        sums, count = {}, 0
        with torch.random.fork_rng(), torch.inference_mode(), autocast():
            for batch in itertools.islice(loader, job.limit_val):
                n = len(inputs_targets(batch)[1])
                for k, v in val_metrics(model, batch).items():
                    sums[k] = sums[k] + v.float() * n if k in sums else v.float() * n
                count += n
        model.train()
        val_curve.append((step, {f"val/{k}": v.item() / count for k, v in sums.items()}))

    model.train()
    step, epoch, validated = 0, 0, False
    while step < job.max_steps and (job.max_epochs is None or epoch < job.max_epochs):
        loader = user_train or DataLoader(
            train, batch_size=BATCH, shuffle=True, drop_last=job.drop_last,
            num_workers=job.workers, collate_fn=collate_for(job),
            generator=torch.Generator().manual_seed(derive_seed(job.seed, epoch, 0)),
            worker_init_fn=functools.partial(seed_worker, job.seed, epoch) if job.workers else None)
        batches, consumed = iter(loader), 0
        while step < job.max_steps and (group := list(itertools.islice(batches, job.accumulate))):
            consumed += len(group)
            sizes = [len(inputs_targets(b)[1]) for b in group]
            buffers = {k: b.clone() for k, b in model.named_buffers()}
            step_loss = 0
            for batch, n in zip(group, sizes):
                with autocast():
                    loss = loss_of(model, batch)
                loss = loss * (n / sum(sizes))  # each micro-batch weighs its share of samples
                loss.backward()
                step_loss = step_loss + loss.detach()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            if job.skip_nan and not torch.isfinite(step_loss + norm):
                # the skipped step leaves no trace on the model (its forward's random draws
                # were made, as in any forward)
                opt.zero_grad(set_to_none=True)
                for k, b in model.named_buffers():
                    b.copy_(buffers[k])
            else:
                opt.step()
                opt.zero_grad(set_to_none=True)
                sched.step()
                window.append(step_loss)
            step += 1
            pending += 1
            if step % LOG_EVERY == 0:
                log()
                pending = 0
            validated = (step % job.val_every == 0 if job.val_every
                         else consumed == len(loader))
            if validated:
                evaluate()
        if step < job.max_steps:
            epoch += 1
    if pending:
        log()
    if not validated:
        evaluate()
    return {"steps": step, "model": model.state_dict(), "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(), "val": val_curve, "train": train_curve}


# ---------------------------------------------------------------------- saferun's side

class Curves(saferun.Callback):
    """What saferun logged, as every callback and logger sees it."""

    def __init__(self) -> None:
        self.train: list[tuple[int, float]] = []
        self.val: list[tuple[int, dict[str, float]]] = []

    def on_log(self, view, metrics):  # type: ignore[no-untyped-def]
        if "train/loss" in metrics:
            self.train.append((view.step, metrics["train/loss"]))

    def on_validation_end(self, view, metrics):  # type: ignore[no-untyped-def]
        self.val.append((view.step, dict(metrics)))


class Differential(saferun.Trainer):
    def __init__(self, cfg: dict[str, Any], job: Job, curves: Curves, stop: bool) -> None:
        super().__init__(cfg, callbacks=[curves])
        self.job, self.stop_pending = job, stop

    def build_model(self) -> nn.Module:
        return model_for(self.job)

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        return datasets_for(self.job)

    def build_dataloaders(self, train, val):  # type: ignore[no-untyped-def]
        if self.job.user_loader:
            return user_loaders(self.job, train, val)
        return super().build_dataloaders(train, val)

    def training_step(self, batch: Any) -> torch.Tensor:
        self._stop_if_planted("training", self.state.step + 1)
        return loss_of(self.model, batch)

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        self._stop_if_planted("validation", self.state.step)
        return val_metrics(self.model, batch)

    def _stop_if_planted(self, where: str, step: int) -> None:
        if self.stop_pending and self.job.stop == where and step == self.job.stop_at:
            self.stop_pending = False
            os.kill(os.getpid(), signal.SIGTERM)  # a real preemption signal, in this process


def config(job: Job, run_dir: Any, resume: Optional[str] = None) -> dict[str, Any]:
    trainer = dict(max_steps=job.max_steps, max_epochs=job.max_epochs, batch_size=BATCH,
                   accumulate=job.accumulate, drop_last=job.drop_last, num_workers=job.workers,
                   precision=job.precision, max_grad_norm=CLIP, log_every_n_steps=LOG_EVERY,
                   val_every_n_steps=job.val_every, limit_val_batches=job.limit_val,
                   run_dir=str(run_dir), progress_bar=False, device="cpu")
    collate = ({"_target_": f"{__name__}.collate_batch", "_partial_": True}
               if job.batch == "dataclass" and not job.user_loader else None)
    return {"trainer": trainer, "seed": job.seed, "resume": resume, "collate_fn": collate,
            "optim": {"_target_": "torch.optim.AdamW", "lr": LR, "weight_decay": DECAY},
            "sched": {"_target_": "torch.optim.lr_scheduler.StepLR", "step_size": 3, "gamma": 0.8},
            "guards": {"nonfinite": "skip"} if job.skip_nan else {},
            "logger": ({"tensorboard": {"_target_": "saferun.loggers.TensorBoardLogger"}}
                       if job.tensorboard else {})}


def through_saferun(job: Job, run_dir: Any) -> dict[str, Any]:
    curves, resume = Curves(), None
    if job.stop is not None:
        with pytest.raises(Preempted):
            Differential(config(job, run_dir), job, curves, stop=True).fit()
        resume = "auto"
    t = Differential(config(job, run_dir, resume), job, curves, stop=False)
    t.fit()
    return {"steps": t.state.step, "model": t.model.state_dict(),
            "optimizer": t.optimizer.state_dict(), "scheduler": t.scheduler.state_dict(),
            "val": curves.val, "train": curves.train}


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["steps"] == want["steps"]
    assert list(got["model"]) == list(want["model"])
    for k, v in want["model"].items():  # parameters and buffers (BatchNorm statistics)
        assert torch.equal(got["model"][k], v), k
    opt_got, opt_want = got["optimizer"], want["optimizer"]
    assert opt_got["param_groups"] == opt_want["param_groups"]
    assert opt_got["state"].keys() == opt_want["state"].keys()
    for i, state in opt_want["state"].items():
        for k, v in state.items():
            assert torch.equal(opt_got["state"][i][k], v), (i, k)
    assert got["scheduler"] == want["scheduler"]
    assert got["val"] == want["val"]
    assert got["train"] == want["train"]


def check(job: Job, tmp_path: Any) -> dict[str, Any]:
    want = reference(job)
    assert want["val"] and want["train"]  # the job validates and logs: the curves are compared
    got = through_saferun(job, tmp_path / "run")
    assert_same(got, want)
    return want


# ---------------------------------------------------------------------- the grid

def case(job: Job, *marks: Any) -> Any:
    fields = [f"{f.name}={getattr(job, f.name)}" for f in dataclasses.fields(Job)
              if getattr(job, f.name) != f.default]
    return pytest.param(job, marks=marks, id="-".join(fields) or "defaults")


def steps_for(accumulate: int) -> int:
    return 15 if accumulate == 1 else 5  # into the third epoch (6 or 5 batches an epoch)


CORE = [Job(accumulate=a, drop_last=d, workers=w, precision=p, max_steps=steps_for(a))
        for a in (1, 3) for d in (False, True) for w in (0, 2) for p in ("fp32", "bf16")]
FAST = [
    Job(accumulate=3, batch="dict", max_epochs=3, max_steps=1000),
    Job(drop_last=True, workers=2, precision="bf16", val_every=4, limit_val=2),
    Job(user_loader=True),
    # mid-epoch 1, two steps after a log point; augmentation in this process: every RNG counts
    Job(stop="training", stop_at=10),
    Job(drop_last=True, workers=2, val_every=4, stop="training", stop_at=5),  # end of epoch 0
]
FAST += [
    Job(skip_nan=True),  # issue 10 item 1
    Job(user_loader=True, batch="dataclass", accumulate=3, max_steps=5),  # issue 10 item 10
    Job(batch="dataclass", workers=2, accumulate=3, max_steps=5),  # the config's collate_fn
    Job(user_loader=True, stop="training", stop_at=9),  # issue 10 item 5: from the second epoch
]
FAST += [
    Job(stop="validation", stop_at=6),  # issue 11 item 8
    # the same, reached another way: a signal during an epoch's last step stops the epoch-end
    # validation due right after it; the resumed run must run that validation first
    Job(accumulate=3, stop="training", stop_at=2, max_steps=5),
]
SLOW = [job for job in CORE if job not in FAST] + [
    Job(batch="dict", workers=2, accumulate=3, drop_last=True, max_steps=5),
    Job(user_loader=True, accumulate=3, drop_last=True, max_steps=5, precision="bf16"),
    Job(max_epochs=2, max_steps=1000, drop_last=True, val_every=3),
] + [Job(accumulate=a, workers=w, drop_last=d, stop="training", stop_at=at, val_every=4,
         max_steps=steps_for(a))
     for a, at in ((1, 3), (1, 6), (1, 11), (3, 3)) for w in (0, 2) for d in (False, True)]


@pytest.mark.parametrize("job", [case(j) for j in FAST])
def test_saferun_equals_the_reference_loop(job, tmp_path):
    check(job, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("job", [case(j) for j in SLOW])
def test_saferun_equals_the_reference_loop_grid(job, tmp_path):
    check(job, tmp_path)


def test_the_tensorboard_validation_curve_equals_the_reference(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    want = check(Job(accumulate=3, val_every=1, max_steps=4, tensorboard=True), tmp_path)
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    for key in ("val/loss", "val/acc"):  # event files hold float32
        logged = [(e.step, e.value) for e in events.Scalars(key)]
        assert logged == [(s, float(np.float32(m[key]))) for s, m in want["val"]]
