"""The training batches, step by step across epochs, resumable to the exact position."""

from __future__ import annotations

import itertools
import math
from typing import Any, Iterator, Optional

import torch
from torch.utils.data import DataLoader, IterableDataset

from ..data import (IndexRecorder, ShardedStream, epoch_state, restore_epoch_state,
                    set_loader_epoch)
from ..errors import SaferunError
from ..guards.preflight import check_batch_on_cpu
from .. import distributed
from ..preemption import shielded_iter
from ..data.seeding import get_rng_state, set_rng_state
from ..state import LoopState
from ..data.transfer import move_to_device


class BatchStream:
    """Groups of `trainer.accumulate` micro-batches, one per optimizer step, across epochs.

    Args:
        loader: the training DataLoader (saferun's or the user's).
        t: the `trainer` config node (max_steps, max_epochs, accumulate, batch_size).
        seed: the run's seed (each epoch's shuffle derives from it).
        state: the loop state; the stream advances its epoch and position.
        check_first_batch: check that the first worker batch holds only CPU tensors.
        data: the data-parallel ranks the loader splits the data over (the strategy's).
    """

    def __init__(self, loader: DataLoader, t: Any, seed: int, state: LoopState,
                 check_first_batch: bool, data: distributed.Ranks = distributed.Ranks()) -> None:
        self._loader, self._t, self._seed, self._state = loader, t, seed, state
        self._data = data
        stream = loader.dataset  # shards that may differ in length: a stream that splits itself
        self._uneven = data.world_size > 1 and isinstance(stream, ShardedStream) and stream.presplit
        self._check_first_batch = check_first_batch
        self.epoch_start: Optional[dict[str, Any]] = None  # what this epoch is drawn from
        self.resume_epoch_start: Optional[dict[str, Any]] = None  # set by a resume
        self.resume_rng: Optional[dict[str, Any]] = None  # the RNG states to restore
        self.mid_step = False  # a step's batches are out and the loop has not asked for more

    def groups(self) -> Iterator[tuple[list[Any], bool, Any]]:
        """Yield (micro-batches of one step, is it the epoch's last step, where) across epochs.
        A stream (an IterableDataset) has no length: when it runs out, ([], True, None) ends
        its epoch after the last step, as a map-style epoch's last step does.

        `where` is (epoch, [sample indices of each micro-batch]), or None when the
        loader does not record indices (a user-built DataLoader).

        After a resume, the RNG and sampler states of the interrupted epoch's start are
        put back, the epoch replays its batches up to the saved position (loading only,
        no compute; the same order, and workers draw the same augmentations again), then
        the step's RNG states are restored: the run continues exactly as if it had not
        stopped, with saferun's loaders and with loaders built by the user.
        """
        t, state, loader = self._t, self._state, self._loader
        per_epoch = None if self.steps_per_epoch() is None else len(loader)  # None: a stream
        recorder = loader.batch_sampler if isinstance(loader.batch_sampler, IndexRecorder) else None
        limit = math.inf if t.max_steps is None else t.max_steps
        if state.batches_in_epoch and self.resume_rng is None and self.epoch_start is not None:
            # a second fit() after one that ended mid-epoch: continue as a resume would
            self.resume(get_rng_state(), self.epoch_start)
        while state.step < limit and (t.max_epochs is None or state.epoch < t.max_epochs):
            set_loader_epoch(loader, self._seed, state.epoch, self._data.rank)
            if self.resume_epoch_start is not None:  # a user-built loader draws from these
                restore_epoch_state(loader, self.resume_epoch_start)
                self.resume_epoch_start = None
            self.epoch_start = epoch_state(loader)
            batches = shielded_iter(loader)  # its workers ignore signals to the process group
            for _ in itertools.islice(batches, state.batches_in_epoch):
                if recorder is not None:
                    recorder.take()
            if self.resume_rng is not None:
                set_rng_state(self.resume_rng)
                self.resume_rng = None
            while state.step < limit and (group := self._next_group(batches)):
                if self._check_first_batch:
                    check_batch_on_cpu(group[0])  # what the first worker batch holds
                    self._check_first_batch = False
                state.batches_in_epoch += len(group)
                # (`is not None`: an IndexRecorder's truth is its length, four calls deep)
                where = (state.epoch, recorder.take(len(group))) if recorder is not None else None
                self.mid_step = True  # until the loop asks for the next step (see _preempted)
                yield group, per_epoch is not None and state.batches_in_epoch >= per_epoch, where
                self.mid_step = False
            if state.step >= limit:
                return
            if state.batches_in_epoch == 0:
                raise SaferunError(
                    f"the training DataLoader yielded no batches in epoch {state.epoch}. With "
                    f"drop_last=True it needs at least batch_size={t.batch_size} samples.")
            if per_epoch is None:  # a stream's epoch ends when it runs out: known only now
                yield [], True, None  # (the loop validates, saves or stops as at an epoch's end)
            state.epoch += 1
            state.batches_in_epoch = 0

    def steps_per_epoch(self) -> Optional[int]:
        """Optimizer steps in one epoch; None for a stream (an IterableDataset: no length)."""
        if isinstance(self._loader.dataset, IterableDataset):
            return None
        return -(-len(self._loader) // self._t.accumulate)

    def _next_group(self, batches: Iterator[Any]) -> list[Any]:
        """The next step's micro-batches; [] at the epoch's end. Shards of a stream that
        splits itself may differ in length: the ranks agree, so that the epoch ends for all
        of them when one runs out (a rank left waiting in the gradient all-reduce would hang)."""
        if self._t.accumulate == 1:  # (one micro-batch: no loop to build the group)
            batch = next(batches, _END)
            group = [] if batch is _END else [batch]
        else:
            group = take(batches, self._t.accumulate)
        if self._uneven and not distributed.on_every_rank(bool(group)):
            return []
        return group

    def position_state(self) -> Optional[dict[str, Any]]:
        """What the current epoch is drawn from, for a checkpoint. Before an epoch has started
        (or after the last one ended) the next one starts from now; right after a resume,
        before the loop restarted, from the loaded checkpoint's start."""
        if self._state.batches_in_epoch:
            return self.resume_epoch_start or self.epoch_start
        return epoch_state(self._loader)

    def resume(self, rng: Optional[dict[str, Any]], epoch_start: Optional[dict[str, Any]]) -> None:
        """Restore these at the next `groups()`: the epoch's start, then the step's RNG states."""
        self.resume_rng, self.resume_epoch_start = rng, epoch_start


_END = object()  # what next() gives at the end of an epoch (a batch may be anything, even None)


def take(iterator: Iterator[Any], n: int) -> list[Any]:
    group = []
    for batch in iterator:
        group.append(batch)
        if len(group) == n:
            break
    return group


def first_batch(loader: DataLoader, seed: int, rank: int, device: torch.device,
                non_blocking: bool) -> Any:
    """Epoch 0's first batch on the device, leaving the loader's generators as they were."""
    found = epoch_state(loader)
    try:
        set_loader_epoch(loader, seed, 0, rank)
        return move_to_device(next(shielded_iter(loader)), device, non_blocking)
    finally:
        restore_epoch_state(loader, found)
