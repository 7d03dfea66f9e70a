"""trainer.strategy=ddp: every rank holds the whole model, and the gradients are averaged once per
optimizer step with DistributedDataParallel (`GradientSync`), or by saferun where training_step
bypasses DDP's forward (`average_gradients`)."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..errors import SaferunError
from ..distributed import BUCKET_BYTES, _buckets, all_reduce, broadcast_buffers

log = logging.getLogger("saferun")
__all__ = ["BUCKET_BYTES", "GradientSync", "ModelDDP", "average_gradients"]


class ModelDDP(DistributedDataParallel):
    """DistributedDataParallel that also answers attribute lookups of the wrapped model,
    and notes whether its forward ran (with autograd on) since `forwarded` was reset.

    While `probing`, its forward calls the model directly: DDP's own machinery is
    left untouched until `GradientSync` knows whether training_step goes through it.
    """

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            self.__dict__["forwarded"] = True  # plain attribute: no nn.Module bookkeeping
        if self.__dict__.get("probing"):
            return self.module(*inputs, **kwargs)
        return super().forward(*inputs, **kwargs)


class GradientSync:
    """Averages the gradients over ranks whatever training_step calls; copies rank 0's buffers.

    DistributedDataParallel averages gradients during backward, overlapped with it, but only
    for parameters of a forward that went through `DDP.forward`: a training_step calling
    submodules (`self.model.head(self.model.backbone(x))`) bypasses it, and the ranks would
    silently diverge. So the first step probes: `self.model` is the DDP wrapper, whose forward
    only notes that it ran, and saferun averages that step's gradients itself. If every rank's
    training_step went through `self.model(...)` in every micro-batch, later steps use DDP
    (and a later step that does not raises: the other ranks would be waiting in DDP's
    all-reduce). Otherwise, and always with find_unused_parameters, saferun averages after
    the last micro-batch's backward: one all-reduce per 25 MiB of gradients per optimizer
    step, not overlapped with backward (with find_unused_parameters also one host read per
    step, as DDP has).

    After each step's backward, rank 0's buffers are broadcast to every rank (DDP does it
    before the next forward), so the ranks hold identical models for evaluation and saving.
    """

    def __init__(self, model: nn.Module, device: torch.device, find_unused: bool,
                 manual: bool = False) -> None:
        self.module, self.find_unused = model, find_unused
        self.ddp = ModelDDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                            find_unused_parameters=find_unused, forward_sync_buffers=False)
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        # "ddp" or "saferun", agreed after the first step. DDP's find_unused_parameters fails
        # on a parameter used both inside self.model(...) and outside it: saferun averages.
        # "manual": several optimizers, each optimize() averages its own (loop/manual.py).
        self.mode: Optional[str] = "manual" if manual else "saferun" if find_unused else None
        self.ddp.__dict__["probing"] = self.mode is None
        self._all_forwarded = True  # DDP's constructor made rank 0's weights and buffers everyone's

    @property
    def model(self) -> nn.Module:
        """What `self.model` is during training_step."""
        return self.module if self.mode in ("saferun", "manual") else self.ddp

    @contextlib.contextmanager
    def micro_batch(self, last: bool, step: int) -> Iterator[None]:
        """Around one micro-batch's forward and backward; the last one averages the gradients."""
        ddp = self.ddp
        ddp.__dict__["forwarded"] = False
        with ddp.no_sync() if self.mode == "ddp" and not last else contextlib.nullcontext():
            yield
        if self.mode is None:
            self._all_forwarded &= ddp.__dict__["forwarded"]
        if not last:
            return
        if self.mode == "manual":
            pass  # each optimize() averaged its optimizer's gradients
        elif self.mode != "ddp":  # the probing step, or training_step bypasses DDP
            average_gradients(self.named, self.find_unused, step)
            if self.mode is None:
                self._agree(step)
        elif not ddp.__dict__["forwarded"]:
            raise SaferunError(
                f"step {step}: training_step did not call self.model(...) on rank "
                f"{dist.get_rank()}, though it did at the first step. DistributedDataParallel "
                f"averages the gradients only of steps that go through it, so the ranks would "
                f"diverge. Call self.model(...) in every step, or in none (calling submodules "
                f"only: saferun then averages the gradients itself).")
        broadcast_buffers(self.module)

    def _agree(self, step: int) -> None:
        flag = torch.full((), float(self._all_forwarded), device=self.named[0][1].device)
        everywhere = all_reduce(flag).item() == dist.get_world_size()  # once, at the first step
        self.mode = "ddp" if everywhere else "saferun"
        self.ddp.__dict__["probing"] = False
        if not everywhere and dist.get_rank() == 0:
            log.info("training_step does not always go through self.model(...): saferun "
                     "averages the gradients itself after backward (one all-reduce per step, "
                     "not overlapped with backward as DistributedDataParallel's is).")


def average_gradients(named: Sequence[tuple[str, nn.Parameter]], find_unused: bool,
                      step: int) -> None:
    """Replace every gradient by its mean over ranks, in buckets of BUCKET_BYTES.

    A parameter without a gradient on this rank counts as zero; with `find_unused`, one
    that has none on any rank keeps none (as with DDP), which needs one host read.
    """
    missing = [n for n, p in named if p.grad is None]
    sparse = [n for n, p in named if p.grad is not None and p.grad.is_sparse]
    if sparse:
        raise SaferunError(
            f"step {step}: sparse gradients ({', '.join(sparse[:8])}) are averaged only by "
            f"DistributedDataParallel: call self.model(...) in training_step.")
    if missing and not find_unused:
        raise SaferunError(
            f"step {step}: {len(missing)} trainable parameter(s) received no gradient on rank "
            f"{dist.get_rank()}: {', '.join(missing[:8])}{', ...' if len(missing) > 8 else ''}. "
            f"Under torchrun every trainable parameter needs a gradient at every step: freeze "
            f"them (trainer.frozen_modules) or set trainer.find_unused_parameters=true.")
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in named]
    used = None
    if find_unused:
        flags = torch.tensor([p.grad is not None for _, p in named], dtype=torch.float32)
        used = all_reduce(flags.to(grads[0].device)).tolist()
    world = dist.get_world_size()
    for bucket in _buckets(grads):
        flat = torch.cat([g.reshape(-1) for g in bucket]).div_(world)
        dist.all_reduce(flat)
        for g, part in zip(bucket, flat.split([g.numel() for g in bucket])):
            g.copy_(part.view_as(g))
    for (_, p), g, u in zip(named, grads, used or [1.0] * len(named)):
        p.grad = g if u else None
