"""Checkpoint formats: how the model and optimizer state of a run goes into a checkpoint and
back, one class per format behind `CheckpointFormat`. The parallel strategy names its format
(`Strategy.checkpoint_format`); the `Checkpointer` keeps the rest (what `state.pt` holds, the
manifest and atomic write, rotation, the run directory) and calls the format at each save,
load and weights export.

- `WholeState`: the whole model and optimizer state inside `state.pt`, written by rank 0
  (one process, DDP).
- `ShardedState`: every rank writes its shards beside `state.pt` (`sharded.py`, FSDP),
  perhaps in the background; resharded on load for another number of processes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

import torch
from torch import nn

from ..loop.optimizers import check_state_kind
from .store import CheckpointError, Storage, save_checkpoint
from .weights import load_weights


class CheckpointFormat(Protocol):
    """What the Checkpointer asks of a format. Every rank calls each method."""

    reshards: bool  # loads a checkpoint written by another number of processes

    def save(self, root: Path, step: int, state: dict[str, Any], model: nn.Module,
             optimizer: Any, after: Callable[[Path], None], storage: Storage) -> None:
        """Write checkpoint `step` of `state` (`Trainer.state_dict`) under `root` in `storage`;
        `after(path)` runs once it is complete (rotation)."""

    def finish(self) -> None:
        """Complete a save still in flight (a no-op for a format that writes at once)."""

    def load(self, state: Mapping[str, Any], model: nn.Module, optimizer: Any, ema: Any) -> None:
        """The model's and optimizer's state from a loaded checkpoint (`load_checkpoint`), and
        trainer.ema's average (`ema`; None: off), which a checkpoint without one starts from
        the loaded weights."""

    def load_model(self, path: Path, state: Mapping[str, Any], model: nn.Module, ema: Any) -> None:
        """The model's weights (and `ema`'s) only, from checkpoint `path` (evaluation,
        restore_best)."""

    def export(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The model's whole weights, for model.pt (on rank 0)."""


class WholeState:
    """The whole model and optimizer state in `state.pt`, written by rank 0."""

    reshards = False

    def __init__(self, main: bool) -> None:
        self._main = main  # rank 0 writes; every rank holds the same state

    def save(self, root: Path, step: int, state: dict[str, Any], model: nn.Module,
             optimizer: Any, after: Callable[[Path], None], storage: Storage) -> None:
        if self._main:
            after(save_checkpoint(root, step, state, storage))

    def finish(self) -> None:
        pass

    def load(self, state: Mapping[str, Any], model: nn.Module, optimizer: Any, ema: Any) -> None:
        load_weights(model, whole_weights(state.get("sharded", {}).get("path"), state),
                     "the checkpoint")
        check_state_kind(state["optimizer"], optimizer)  # one optimizer, or several by name
        optimizer.load_state_dict(state["optimizer"])
        if ema is not None:
            ema.load_state_dict(state.get("ema"))

    def load_model(self, path: Path, state: Mapping[str, Any], model: nn.Module, ema: Any) -> None:
        load_weights(model, whole_weights(path, state), path)
        if ema is not None:
            ema.load_state_dict(state.get("ema"))

    def export(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return model.state_dict()


class Registers(Protocol):
    """Where a sharded writer registers, so that the ranks complete an asynchronous save
    together (`parallel.agreement.RankAgreement.complete_together`)."""

    def complete_together(self, work: Any) -> None: ...


class ShardedState:
    """Each rank's shards of the model and optimizer beside `state.pt` (`sharded.py`, DCP)."""

    reshards = True

    def __init__(self, async_save: bool, agreement: Registers) -> None:
        self._async_save, self._agreement = async_save, agreement
        self._writer: Any = None  # sharded.ShardedWriter, made at the first save

    def save(self, root: Path, step: int, state: dict[str, Any], model: nn.Module,
             optimizer: Any, after: Callable[[Path], None], storage: Storage) -> None:
        from . import sharded  # torch.distributed.checkpoint: imported only when needed

        if self._writer is None:
            self._writer = sharded.ShardedWriter(self._async_save)
            self._agreement.complete_together(self._writer)  # an asynchronous save's end
        self._writer.save(root, step, state, model, optimizer, after, storage)

    def finish(self) -> None:
        if self._writer is not None:
            self._writer.finish()

    def load(self, state: Mapping[str, Any], model: nn.Module, optimizer: Any, ema: Any) -> None:
        """Every rank reads its shards (resharded for another world size)."""
        from . import sharded

        sharded.load(Path(state.get("sharded", {}).get("path", "?")), state, model, optimizer, ema)

    def load_model(self, path: Path, state: Mapping[str, Any], model: nn.Module, ema: Any) -> None:
        from . import sharded

        sharded.load(path, dict(state), model, None, ema)

    def export(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Gathered from every rank."""
        from .sharded import full_weights

        return full_weights(model)


def whole_weights(path: Any, state: Mapping[str, Any]) -> Any:
    """The whole weights of a checkpoint, for a run that does not shard; refused for shards."""
    if "sharded" in state:
        raise CheckpointError(
            f"{path} was written by trainer.strategy=fsdp (the weights sharded over "
            f"{state['sharded']['world_size']} processes) and this run does not shard the model. "
            f"Resume with trainer.strategy=fsdp, or use the run's model.pt (whole weights).")
    return state["model"]

