"""DataLoaders with seeded shuffling and workers, their exact-resume state, and `ShardedStream`.
(Moving batches to the device: `saferun.data.transfer`, re-exported here.)"""

from __future__ import annotations

import collections
import copy
import itertools
import logging
import os
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch.utils.data import (BatchSampler, DataLoader, Dataset, DistributedSampler,
                              IterableDataset, RandomSampler, Sampler, SequentialSampler,
                              get_worker_info)

from ..distributed import ShardSampler
from ..errors import SaferunError
from .generators import rng_kind, rng_objects
from .seeding import WorkerSeeder, derive_seed, get_rng_state, set_rng_state
from .transfer import batch_size_of, move_to_device, to_host  # noqa: F401  (saferun.data's names)

log = logging.getLogger("saferun")


class IndexRecorder(Sampler[list[int]]):
    """A batch sampler wrapper that remembers the sample indices of each batch.

    The DataLoader draws index batches ahead of their use (workers prefetch) and
    delivers the batches in the same order, so the oldest pending entry always
    belongs to the next batch the loop receives: `take()` after each batch.
    """

    def __init__(self, batch_sampler: BatchSampler) -> None:
        self.batch_sampler = batch_sampler
        self.pending: collections.deque[list[int]] = collections.deque()

    def __iter__(self) -> Iterator[list[int]]:
        self.pending.clear()  # a new epoch's iterator
        for indices in self.batch_sampler:
            self.pending.append(indices)
            yield indices

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def take(self, n: int = 1) -> list[Optional[list[int]]]:
        """The indices of the next `n` batches the loop receives (None for one it drew before
        this recorder saw its indices); one call per step, however many micro-batches."""
        pending = self.pending
        if n == 1:  # (one micro-batch, most steps: no comprehension's frame)
            return [pending.popleft() if pending else None]
        return [pending.popleft() if pending else None for _ in range(n)]


def make_loader(
    dataset: Dataset,
    *,
    batch_size: int,
    shuffle: bool,
    drop_last: bool,
    num_workers: int,
    pin_memory: bool,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    evaluation: bool = False,
    multiprocessing_context: Optional[str] = None,
    collate_fn: Optional[Callable[[list[Any]], Any]] = None,
    limit: Optional[int] = None,
) -> DataLoader:
    """A DataLoader whose order and worker seeds follow from `seed` (see `set_loader_epoch`).

    Map-style datasets get an `IndexRecorder` batch sampler, so that errors can
    name the samples of a bad step. With several ranks, training data is split
    by a DistributedSampler and evaluation data by a `ShardSampler` (no padding,
    so every sample counts once in the metrics). `limit` (evaluation of a map-style
    dataset): only its first `limit` samples, split over the ranks, so that a limit
    means the same samples whatever the number of processes.
    """
    generator = torch.Generator()
    workers: dict[str, Any] = dict(num_workers=num_workers, pin_memory=pin_memory, collate_fn=collate_fn,
                   worker_init_fn=WorkerSeeder(seed, rank) if num_workers > 0 else None,
                   multiprocessing_context=multiprocessing_context if num_workers > 0 else None)
    if isinstance(dataset, IterableDataset):
        if evaluation and isinstance(dataset, ShardedStream):
            stream = copy.copy(dataset)
            stream.drop_uneven = False  # evaluation has no collective per batch: keep every item
            dataset = stream
        return DataLoader(dataset, batch_size=batch_size, drop_last=drop_last,
                          generator=generator, **workers)
    sampler: Sampler[int]
    if evaluation and (world_size > 1 or limit is not None):
        n = len(dataset)  # type: ignore[arg-type]
        sampler = ShardSampler(n if limit is None else min(n, limit), rank, world_size)
    elif world_size > 1:
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle,
                                     seed=seed, drop_last=drop_last)
    else:
        sized: Any = dataset  # map-style: it has a length
        sampler = RandomSampler(sized, generator=generator) if shuffle else SequentialSampler(sized)
    batches = IndexRecorder(BatchSampler(sampler, batch_size, drop_last))
    return DataLoader(dataset, batch_sampler=batches, generator=generator, **workers)


def make_loaders(train: Dataset, val: Optional[Dataset], t: Any, seed: int, rank: int,
                 world_size: int, pin_memory: bool, collate_fn: Optional[Callable[[list[Any]], Any]]
                 ) -> tuple[DataLoader, Optional[DataLoader]]:
    """The default training and validation loaders for the `trainer` config node `t`."""
    common = loader_options(t, seed, rank, world_size, pin_memory, collate_fn)
    train_loader = make_loader(train, batch_size=t.batch_size, shuffle=t.shuffle,
                               drop_last=t.drop_last, **common)
    val_loader = None
    if val is not None:
        val_loader = evaluation_loader(val, t, t.limit_val_batches, **common)
    return train_loader, val_loader


def loader_options(t: Any, seed: int, rank: int, world_size: int, pin_memory: bool,
                   collate_fn: Optional[Callable[[list[Any]], Any]]) -> dict[str, Any]:
    """What every loader saferun builds takes from the `trainer` node `t` and the run."""
    return dict(num_workers=t.num_workers, seed=seed, rank=rank, world_size=world_size,
                pin_memory=pin_memory, multiprocessing_context=t.multiprocessing_context,
                collate_fn=collate_fn)


def evaluation_loader(dataset: Dataset, t: Any, limit_batches: Optional[int], **common: Any
                      ) -> DataLoader:
    """The loader of a validation or test set: in order, val_batch_size, split over the ranks
    without padding; `limit_batches`: only the first that many batches' samples."""
    size = t.val_batch_size or t.batch_size
    limit = None if limit_batches is None else limit_batches * size
    return make_loader(dataset, batch_size=size, shuffle=False, drop_last=False,
                       evaluation=True, limit=limit, **common)


def split_datasets(sets: Any, task: str) -> tuple[Dataset, Optional[Dataset], Optional[Dataset]]:
    """build_datasets()'s result: (train, val) or (train, val, test); a lone Dataset is train."""
    if isinstance(sets, Dataset):
        return sets, None, None
    if isinstance(sets, (tuple, list)) and len(sets) in (2, 3):
        return sets[0], sets[1], sets[2] if len(sets) == 3 else None
    raise SaferunError(f"{task}.build_datasets() returned {type(sets).__name__}"
                       f"{f' of {len(sets)}' if isinstance(sets, (tuple, list)) else ''}: return "
                       f"(train, val) or (train, val, test), val and test may be None.")


def check_evaluation_limit(loader: Optional[DataLoader], t: Any, world_size: int) -> None:
    """Under torchrun, trainer.limit_val_batches (node `t`) must mean the same samples as in
    one process: the first limit x val_batch_size. saferun's validation loader over a
    map-style dataset holds only those (`make_loader`'s limit); refuse any other, where each
    rank would take that many batches of its own share instead."""
    if loader is None or t.limit_val_batches is None or world_size == 1:
        return
    sampler = sampler_of(loader)
    samples = t.limit_val_batches * (t.val_batch_size or t.batch_size)
    if isinstance(sampler, ShardSampler) and sampler.indices.stop <= samples:  # type: ignore[attr-defined]
        return
    what = ("an IterableDataset" if isinstance(loader.dataset, IterableDataset)
            else "a loader built by build_dataloaders")
    raise SaferunError(
        f"trainer.limit_val_batches={t.limit_val_batches} under torchrun with {world_size} "
        f"processes: the validation data is {what}, which saferun cannot cut to the first "
        f"{samples} samples (limit x val_batch_size, as in one process). Each rank would take "
        f"its first {t.limit_val_batches} batches of its own share, so the validation metrics "
        f"would depend on the number of processes. Remove trainer.limit_val_batches (make the "
        f"validation set itself smaller), or let saferun build the validation loader from a "
        f"map-style dataset.")


def set_loader_epoch(loader: DataLoader, seed: int, epoch: int, rank: int = 0) -> None:
    """Reseed `loader` so that epoch `epoch` has an order and worker seeds of its own.

    Call before `iter(loader)`. Depends only on (seed, epoch, rank), so a resumed
    run sees the same epochs as an uninterrupted one.
    """
    if loader.generator is not None:
        loader.generator.manual_seed(derive_seed(seed, epoch, rank))
    if isinstance(loader.worker_init_fn, WorkerSeeder):
        loader.worker_init_fn.epoch = epoch
    set_epoch = getattr(sampler_of(loader), "set_epoch", None)
    if callable(set_epoch):  # DistributedSampler
        set_epoch(epoch)
    set_epoch = getattr(loader.dataset, "set_epoch", None)
    if isinstance(loader.dataset, IterableDataset) and callable(set_epoch):
        set_epoch(epoch)  # a stream that shuffles per epoch (the convention of HF datasets)


def sampler_of(loader: DataLoader) -> Any:
    """The sampler that orders `loader`'s samples (inside its batch sampler, if any)."""
    batch_sampler = loader.batch_sampler
    if isinstance(batch_sampler, IndexRecorder):
        batch_sampler = batch_sampler.batch_sampler
    return getattr(batch_sampler, "sampler", loader.sampler)


# Where a DataLoader keeps what decides an epoch's order (besides the global RNGs).
_ORDER_PARTS = ("generator", "sampler", "batch_sampler")


def epoch_state(loader: DataLoader) -> dict[str, Any]:
    """What an epoch of `loader` is drawn from, taken just before `iter(loader)`.

    The global RNGs (a sampler without a generator seeds itself from torch's, the
    workers' base seed too, and augmentations without workers draw from all three),
    every `torch.Generator` on the loader and its samplers, and the `state_dict()` of
    a sampler that has one. Saved with checkpoints: a resumed run puts it back before
    replaying the interrupted epoch (`restore_epoch_state`), so a loader built by the
    user shuffles and seeds its workers as the uninterrupted run did.
    """
    return {"rng": get_rng_state(),
            "generators": {path: g.get_state() for path, g in _generators(loader)},
            "samplers": {path: s.state_dict() for path, s in _stateful_samplers(loader)}}


def restore_epoch_state(loader: DataLoader, state: dict[str, Any]) -> None:
    """Put back what `epoch_state` returned (for the same loader, built the same way)."""
    set_rng_state(state["rng"])
    for path, g in _generators(loader):
        if path in state["generators"]:
            g.set_state(state["generators"][path])
    for path, sampler in _stateful_samplers(loader):
        if path in state["samplers"]:
            sampler.load_state_dict(state["samplers"][path])


def resume_limits(loader: DataLoader) -> list[str]:
    """Why a resumed run could not replay `loader`'s epochs exactly ([] when it can)."""
    reasons = []
    if loader.num_workers > 0 and loader.persistent_workers:
        reasons.append("persistent_workers=True: the workers' random state carries over from "
                       "epoch to epoch and is not saved, so a resume after the first epoch draws "
                       "other augmentations. Fix: persistent_workers=False (workers then start "
                       "each epoch from seeds that saferun restores)")
    stateful = tuple(s for _, s in _stateful_samplers(loader))  # their state_dict() covers them
    seen: set[int] = set()
    for name in _ORDER_PARTS[1:]:
        for path, rng in rng_objects(getattr(loader, name), name, (loader.dataset, *stateful)):
            if not isinstance(rng, torch.Generator) and id(rng) not in seen:
                seen.add(id(rng))
                reasons.append(
                    f"{path}: {rng_kind(rng)}, whose state saferun cannot save, so a resumed run "
                    f"shuffles the interrupted epoch differently. Fix: draw from a "
                    f"torch.Generator attribute or the global RNGs, or give the sampler "
                    f"state_dict() and load_state_dict()")
    return reasons


def _generators(loader: DataLoader) -> list[tuple[str, torch.Generator]]:
    found: dict[int, tuple[str, torch.Generator]] = {}
    for name in _ORDER_PARTS:
        for path, rng in rng_objects(getattr(loader, name), name, (loader.dataset,)):
            if isinstance(rng, torch.Generator):
                found.setdefault(id(rng), (path, rng))
    return list(found.values())


def _stateful_samplers(loader: DataLoader) -> list[tuple[str, Any]]:
    found: dict[int, tuple[str, Any]] = {}
    for name, part in (("sampler", loader.sampler), ("batch_sampler", loader.batch_sampler),
                       ("batch_sampler.sampler", sampler_of(loader))):
        if callable(getattr(part, "state_dict", None)) and \
                callable(getattr(part, "load_state_dict", None)):
            found.setdefault(id(part), (name, part))
    return list(found.values())


def shard_index() -> tuple[int, int]:
    """(this reader's shard, number of shards), the readers being every DataLoader worker
    of every torchrun process. It reads RANK and WORLD_SIZE from the environment, so it is
    also right in workers started with spawn, where torch.distributed is not initialised."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    info = get_worker_info()
    worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
    return rank * workers + worker, world * workers


class ShardedStream(IterableDataset):
    """An iterable dataset split across torchrun processes and DataLoader workers.

    `ShardedStream(stream)`: every reader (see `shard_index`) iterates `stream` whole and
    keeps every n-th item from its index (n readers), so `stream` must yield the same items
    in the same order in every process (seed its shuffling by epoch: `set_epoch` is passed
    on). Under torchrun a last round of fewer than n items is dropped in training, so every
    process gets the same number of batches. Exact resume holds. Cost: each reader reads
    the whole stream.

    `ShardedStream(stream, presplit=True)`: `stream` splits itself (by `shard_index()`, or
    torch.distributed's rank and `get_worker_info()`), reading only its part. Its shards may
    differ in length: under torchrun the ranks then agree before each step that every one of
    them still has data (one small CPU collective per step); the epoch ends for all when one
    runs out, and the others' remaining batches of that epoch are not used.
    """

    def __init__(self, stream: Iterable[Any], presplit: bool = False) -> None:
        self.stream, self.presplit = stream, presplit
        self.drop_uneven = True

    def set_epoch(self, epoch: int) -> None:
        set_epoch = getattr(self.stream, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.stream) if self.presplit else self._share(*shard_index())

    def _share(self, index: int, count: int) -> Iterator[Any]:
        items = iter(self.stream)
        even = self.drop_uneven and int(os.environ.get("WORLD_SIZE", 1)) > 1
        while round_ := list(itertools.islice(items, count)):
            if len(round_) == count or (index < len(round_) and not even):
                yield round_[index]


def check_training_loader(loader: DataLoader, world_size: int) -> None:
    """Warn when `loader` cannot be resumed exactly; refuse a stream every worker reads whole."""
    limits = resume_limits(loader)
    if limits:
        log.warning("The training DataLoader cannot be resumed exactly: a run resumed from a "
                    "checkpoint would not equal an uninterrupted one (resume is not exact). "
                    "%s.", "; ".join(limits))
    check_stream(loader, world_size)


def check_stream(loader: DataLoader, world_size: int) -> None:
    """Refuse training data that every process or worker would read whole."""
    dataset = loader.dataset
    if not isinstance(dataset, IterableDataset):
        return _check_sampler_shards(loader, world_size)
    if isinstance(dataset, ShardedStream):
        return
    readers = [f"{world_size} torchrun processes"] if world_size > 1 else []
    readers += [f"{loader.num_workers} DataLoader workers"] if loader.num_workers > 1 else []
    if not readers:
        return
    raise SaferunError(
        f"the training dataset {type(dataset).__name__} is an IterableDataset, and each of "
        f"the {' x '.join(readers)} would read all of it: every sample would be trained on "
        f"several times per epoch. Wrap it in saferun.data.ShardedStream(dataset), which "
        f"gives each process and worker every n-th item; or, if it splits itself (by "
        f"saferun.data.shard_index(), or torch.distributed.get_rank() and "
        f"torch.utils.data.get_worker_info()), in ShardedStream(dataset, presplit=True).")


def _check_sampler_shards(loader: DataLoader, world_size: int) -> None:
    """Under torchrun, a map-style training loader must give each rank its own share: a
    sampler with `num_replicas == world_size` (DistributedSampler, or a custom one like it)."""
    sampler = sampler_of(loader)
    batch_sampler = getattr(loader.batch_sampler, "batch_sampler", loader.batch_sampler)
    if world_size == 1 or world_size in (getattr(sampler, "num_replicas", None),
                                         getattr(batch_sampler, "num_replicas", None)):
        return
    raise SaferunError(
        f"under torchrun with {world_size} processes, the training DataLoader (built by "
        f"build_dataloaders) orders its samples with {type(sampler).__name__}, which does not "
        f"split them between the processes: every rank would train on the whole dataset, so "
        f"each sample would count {world_size} times per epoch. Give the loader "
        f"sampler=DistributedSampler(dataset, shuffle=..., seed=cfg.seed, drop_last=...) (call "
        f"nothing else: saferun sets its epoch), or a sampler of your own with "
        f"num_replicas={world_size} and a rank, or remove the build_dataloaders override so "
        f"that saferun builds the loaders.")


def check_datasets(train: Any, val: Any, processes: int) -> None:
    """`check_dataset` for the training set and, if there is one, the validation set (every
    one of the `processes` needs a validation sample)."""
    check_dataset(train, "training")
    if val is not None:
        check_dataset(val, "validation", processes)


def check_dataset(dataset: Any, name: str, processes: int = 1) -> None:
    """Fail early, with the fix, on an empty dataset, or one with fewer samples than the
    `processes` that each need one (validation under torchrun)."""
    try:
        n = len(dataset)
    except TypeError:
        return  # iterable datasets have no length; an empty one is caught at the first step
    if n == 0:
        raise SaferunError(
            f"the {name} dataset is empty (len == 0). Check the path or filter that builds it "
            f"in build_datasets()."
        )
    if n < processes:
        raise SaferunError(f"the {name} dataset has {n} samples for {processes} processes: "
                           f"every rank needs at least one.")
