"""Several processes with torch.distributed, launched by torchrun (one process per device).

The Trainer detects torchrun's environment (WORLD_SIZE, RANK, LOCAL_RANK),
starts the process group (gloo on CPU, nccl on CUDA) and wraps the model in
DistributedDataParallel. Everything the ranks must agree on goes through one
collective at log points; nothing crosses processes between them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Sampler


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def ranks_from_env() -> Ranks:
    """This process's place in a torchrun job (rank 0 of 1 when not launched by torchrun)."""
    return Ranks(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                 int(os.environ.get("LOCAL_RANK", 0)))


def start(ranks: Ranks, device: torch.device) -> None:
    """Join the process group (once per process); gloo on the CPU, nccl on CUDA."""
    if ranks.world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """All-reduce a tensor in place across ranks (a no-op in a single process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t


def union(keys: list[str]) -> list[str]:
    """The keys seen on any rank, in one order on every rank (`keys` in a single process)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return keys
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, keys)
    return list(dict.fromkeys(k for rank_keys in every for k in rank_keys))


def gather(obj: Any) -> Optional[list[Any]]:
    """Every rank's `obj` on rank 0 (None elsewhere); `[obj]` in a single process."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out: Optional[list[Any]] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def broadcast(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s `obj` on every rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class ModelDDP(DistributedDataParallel):
    """DistributedDataParallel that also answers attribute lookups of the wrapped model.

    The Trainer routes training forwards through it so gradients are averaged
    across ranks, while `self.model.head` in a user's training_step still works.
    """

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)


class ShardSampler(Sampler[int]):
    """Every `world_size`-th index from `rank`: evaluation shards without padding or repeats."""

    def __init__(self, length: int, rank: int, world_size: int) -> None:
        self.indices: Sequence[int] = range(rank, length, world_size)

    def __iter__(self) -> Any:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
