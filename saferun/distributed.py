"""Several processes with torch.distributed, launched by torchrun (one process per device).

The Trainer detects torchrun's environment (WORLD_SIZE, RANK, LOCAL_RANK) and starts the
process group (gloo on CPU, nccl on CUDA); the strategy (`parallel/strategy.py`) says which ranks split
the data (`Ranks.group`: the world, or the data dimension of a device mesh). Everything the
ranks must agree on goes through collectives at log points; nothing crosses processes between
them but what the strategy exchanges in each step.
"""

from __future__ import annotations

import atexit
import datetime
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Iterator, NoReturn, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Sampler

BUCKET_BYTES = 25 * 2**20  # per all-reduce when saferun averages gradients itself (DDP's size)
# A collective's error when another rank failed first (its connection closed, the wait timed out)
PEER_FAILED = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|"
                   r"Timed out waiting|collective operation timeout|NCCL (error|communicator was aborted)|"
                   r"remote worker crash|ProcessGroup\w* .*(aborted|shut ?down)", re.I)


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether `t` is a DTensor (fsdp, mesh): one rank's part of a tensor spread over ranks."""
    tensor = sys.modules.get("torch.distributed.tensor")  # not imported: no DTensor exists
    return tensor is not None and isinstance(t, tensor.DTensor)


@dataclass(frozen=True)
class Ranks:
    """A rank's place among `world_size` ranks: the whole job's (`ranks_from_env`), or the data
    dimension's (the strategy's `data`), whose collectives go over `group` (None: the world)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    group: Any = None  # a ProcessGroup of these ranks; None: the default group (every rank)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def ranks_from_env() -> Ranks:
    """This process's place in a torchrun job (rank 0 of 1 when not launched by torchrun)."""
    return Ranks(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                 int(os.environ.get("LOCAL_RANK", 0)))


def start(ranks: Ranks, device: torch.device, timeout_s: float) -> None:
    """Join the process group (once per process); gloo on the CPU, nccl on CUDA (with gloo
    for CPU tensors). A collective that waits longer than `timeout_s` raises, so a rank
    left waiting by the others ends the job instead of hanging (and ignoring SIGTERM)."""
    if ranks.world_size == 1:
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo",
                                timeout=timeout)
        atexit.register(_leave_group)
    else:  # the command line starts the group before the config is known
        dist.distributed_c10d._set_pg_timeout(timeout)


def _leave_group() -> None:
    """Leave the group saferun started while Python is still whole. Left to interpreter
    teardown, gloo's worker threads can still hold tensors whose release needs the GIL:
    the process then aborts (SIGABRT) after a run that succeeded, and torchrun reports
    the job as failed. A group the user destroyed already is left alone."""
    if dist.is_initialized():
        _never_freed(list(dist.distributed_c10d._world.pg_map))
        dist.destroy_process_group()


def end_process(code: int = 0) -> NoReturn:
    """End this torchrun rank with exit status `code`, skipping interpreter teardown: leave the
    process group, run every `atexit` handler (loggers, DataLoader workers, ...) and flush the
    standard streams while Python is whole, then `os._exit`. Teardown is where gloo can abort a
    rank whose run succeeded (see `_leave_group`); nothing saferun writes waits for it.
    `saferun run` ends its ranks this way; a script of your own may call it as its last line."""
    try:
        _leave_group()
        atexit._run_exitfuncs()  # each runs once: os._exit below skips the interpreter's call
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # closed or broken: nothing more can be said there
                pass
        os._exit(code)


def _never_freed(groups: list[Any]) -> None:
    """Keep the groups alive to the end of the process. After destroy_process_group, gloo's
    threads stay alive while anything still holds a group (seen at exit: gloo_tcp_loop and two
    pt_gloo_runloop threads, with no Python object left holding it); whatever holds it is freed
    during interpreter teardown, and destroying the group then can abort the process
    (`terminate called without an active exception`, SIGABRT) after a run that succeeded. A
    group never freed is never torn down: the operating system ends its threads with the
    process."""
    import ctypes

    for group in groups:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))


def _several(group: Any = None) -> bool:
    return dist.is_initialized() and dist.get_world_size(group) > 1


def all_reduce(t: torch.Tensor, op: str = "sum", group: Any = None) -> torch.Tensor:
    """All-reduce a tensor in place across the ranks of `group` (None: every rank; a no-op in
    a single process)."""
    if _several(group):
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
    return t


def union(keys: list[str], group: Any = None) -> list[str]:
    """The keys seen on any rank of `group`, in one order on each (`keys` in a single process)."""
    if not _several(group):
        return keys
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, keys, group=group)
    return list(dict.fromkeys(k for rank_keys in every for k in rank_keys))


def on_every_rank(flag: bool) -> bool:
    """Whether `flag` holds on every rank: a collective on a CPU tensor, no device sync."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return flag
    return all_reduce(torch.tensor(float(flag))).item() == dist.get_world_size()


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


@torch.no_grad()
def broadcast_buffers(module: nn.Module) -> None:
    """Copy rank 0's buffers to every rank."""
    buffers = list(module.buffers())
    for bucket in _buckets(buffers):
        flat = torch.cat([b.reshape(-1) for b in bucket])
        dist.broadcast(flat.view(torch.uint8) if flat.dtype == torch.bool else flat, src=0)
        if dist.get_rank() != 0:
            for b, part in zip(bucket, flat.split([b.numel() for b in bucket])):
                b.copy_(part.view_as(b))


def _buckets(tensors: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """The tensors grouped by dtype and device, in runs of at most BUCKET_BYTES (or one)."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for group in groups.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for t in group:
            nbytes = t.numel() * t.element_size()
            if bucket and size + nbytes > BUCKET_BYTES:
                yield bucket
                bucket, size = [], 0
            bucket.append(t)
            size += nbytes
        if bucket:
            yield bucket


class ShardSampler(Sampler[int]):
    """Every `world_size`-th index from `rank`: evaluation shards without padding or repeats."""

    def __init__(self, length: int, rank: int, world_size: int) -> None:
        self.indices: Sequence[int] = range(rank, length, world_size)

    def __iter__(self) -> Any:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def several_ranks() -> bool:
    """A process group of 2 or more ranks (then a failure is explained without a replay:
    diagnose/explain_ranks.py)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def peer_failure(exc: BaseException) -> Optional[str]:
    """Under torchrun: the first line of the collective error in `exc` or what it wraps (a
    save's), caused by another rank; else None."""
    seen: Optional[BaseException] = exc
    while seen is not None and several_ranks():
        text = str(seen).strip()
        if isinstance(seen, (RuntimeError, ConnectionError)) and PEER_FAILED.search(text):
            return text.splitlines()[0][:300]
        seen = seen.__cause__ or seen.__context__
    return None
