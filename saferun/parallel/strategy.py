"""The parallel strategy: what the loop calls at named points so that it reads the same in one
process and under torchrun.

- `micro_batch(last)`: around each micro-batch's forward and backward (DDP: the wrapped model and
  the gradient average after the last micro-batch's backward, see `GradientSync`).
- `rank_local(control)`: a callback request made between log points (after each step).
- `stop_votes(signals)` / `count_stop_votes(metrics, signals)`: at a log point, this rank's stop
  signal rides on the metrics' one collective; the sum says whether any rank got one.
- `agreed(control)`: at a log point or validation, the callbacks' requests agreed across ranks.
- `stop_agreed(signals)`: after each step, whether every rank leaves the loop now.
- `gather(obj)`: at a checkpoint, each rank's own state (RNG, pending metrics) onto rank 0.
- `average(named, step)`: several optimizers (`loop/manual.py`), after each optimize()'s backward.

`SingleProcess` does the least at each point; `DataParallel` is DDP; `FullyShardedDataParallel`
is FSDP2 (the model sharded in place by `fsdp.shard_model` during setup; checkpoints written
per rank by `checkpoint/sharded.py`).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, ContextManager, Iterator, Optional, Protocol

import torch

from ..callbacks import Control, _merge, agree
from ..errors import ConfigError
from . import distributed, fsdp

if TYPE_CHECKING:
    from ..preemption import StopSignals

_NO_CONTEXT = contextlib.nullcontext()  # reusable; cheaper than a generator per micro-batch


class ModelOwner(Protocol):
    """What DataParallel needs of the Trainer (a Protocol: no import of the trainer)."""

    model: torch.nn.Module
    device: torch.device
    ranks: distributed.Ranks
    state: Any  # LoopState: the step, for GradientSync's messages


class SingleProcess:
    """One process: nothing wrapped, every request acts at once."""

    sharded = False  # each rank holds a part of the model: checkpoints are written per rank

    def micro_batch(self, last: bool) -> ContextManager[None]:
        return _NO_CONTEXT

    def rank_local(self, control: Optional[Control]) -> Optional[Control]:
        return control

    def agreed(self, control: Optional[Control]) -> Optional[Control]:
        return control

    def stop_votes(self, signals: "StopSignals") -> dict[str, torch.Tensor]:
        return {}

    def count_stop_votes(self, metrics: dict[str, float], signals: "StopSignals") -> None:
        pass

    def stop_agreed(self, signals: "StopSignals") -> bool:
        """A stop signal arrived."""
        return signals.received is not None

    def gather(self, obj: Any) -> Optional[list[Any]]:
        return distributed.gather(obj)

    def average(self, named: list[tuple[str, torch.nn.Parameter]], step: int) -> None:
        """Several optimizers (loop/manual.py): after one optimizer's backward, its gradients
        averaged over ranks. One process: nothing to do."""


class DataParallel(SingleProcess):
    """Under torchrun, every rank holds the whole model; gradients are averaged once per
    optimizer step, and every control-flow decision is agreed across ranks.

    It holds the Trainer (a narrow reference) to put the DDP wrapper in `trainer.model` while
    training_step runs, so that user code calling `self.model(...)` goes through DDP.
    """

    def __init__(self, trainer: ModelOwner, find_unused: bool, several: bool = False) -> None:
        """`several`: several optimizers, each optimize() averages its own gradients."""
        self._trainer = trainer
        self._device = trainer.device
        self._sync = distributed.GradientSync(trainer.model, trainer.device, find_unused,
                                              manual=several)
        self._pending: Optional[Control] = None  # requests not yet agreed
        self._agreed_signal: Optional[int] = None

    @contextlib.contextmanager
    def micro_batch(self, last: bool) -> Iterator[None]:
        """Average the gradients over ranks once per optimizer step, after the last
        micro-batch's backward, whatever training_step calls (see GradientSync)."""
        trainer = self._trainer
        module, trainer.model = trainer.model, self._sync.model  # the DDP wrapper, unless bypassed
        try:
            with self._sync.micro_batch(last, trainer.state.step + 1):
                yield
        finally:
            trainer.model = module

    def average(self, named: list[tuple[str, torch.nn.Parameter]], step: int) -> None:
        """Several optimizers: each optimize() averages its own optimizer's gradients."""
        distributed.average_gradients(named, self._sync.find_unused, step)

    def rank_local(self, control: Optional[Control]) -> Optional[Control]:
        """A request made between log points (on_train_step_end) waits for the next log point
        or validation, where the ranks agree on it."""
        self._pending = _merge(self._pending, control)
        return None

    def agreed(self, control: Optional[Control]) -> Optional[Control]:
        """The callbacks' requests, agreed across ranks (any rank's request counts for all:
        a logger, for one, lives on rank 0 only), so that every rank leaves the loop,
        validates and saves at the same step."""
        pending, self._pending = _merge(self._pending, control), None
        return agree(pending, self._device)

    def stop_votes(self, signals: "StopSignals") -> dict[str, torch.Tensor]:
        """This rank's stop signal, summed over ranks with the log metrics."""
        signum = signals.received or 0
        return {"_stop_votes": torch.full((), float(signum > 0), device=self._device),
                "_stop_signals": torch.full((), float(signum), device=self._device)}

    def count_stop_votes(self, metrics: dict[str, float], signals: "StopSignals") -> None:
        votes, signum = metrics.pop("_stop_votes", 0.0), metrics.pop("_stop_signals", 0.0)
        if votes:
            self._agreed_signal = int(round(signum / votes))
            signals.received = self._agreed_signal  # also on ranks that got none

    def stop_agreed(self, signals: "StopSignals") -> bool:
        """The ranks agreed on a stop signal at the last log point, so that all of them save
        the same step and exit together."""
        return self._agreed_signal is not None


class FullyShardedDataParallel(DataParallel):
    """Under torchrun with trainer.strategy=fsdp: the model sharded (FSDP2), gradients
    reduce-scattered once per optimizer step (see `fsdp.ShardedSync`); every control-flow
    decision agreed across ranks as under DDP."""

    sharded = True

    def __init__(self, trainer: ModelOwner) -> None:  # not DataParallel's: no DDP wrapper
        self._trainer = trainer
        self._device = trainer.device
        self._sync = fsdp.ShardedSync(trainer.model)  # type: ignore[assignment]
        self._pending: Optional[Control] = None
        self._agreed_signal: Optional[int] = None
        self.saves: Any = None  # the Checkpointer's ShardedWriter, set at its first save
        fsdp.check_even_evaluation(getattr(trainer, "val_loader", None),
                                   trainer.cfg.trainer.limit_val_batches)  # type: ignore[attr-defined]

    def micro_batch(self, last: bool) -> ContextManager[None]:  # type: ignore[override]  # any context manager
        return self._sync.micro_batch(last, self._trainer.state.step + 1)  # type: ignore[attr-defined]

    def stop_votes(self, signals: "StopSignals") -> dict[str, torch.Tensor]:
        """Also, while an asynchronous save is in flight, whether this rank's write is done:
        summed with the stop votes, so the ranks complete it together at no extra collective."""
        votes = super().stop_votes(signals)
        written = self.saves.written() if self.saves is not None else None
        if written is not None:  # the same on every rank: the save began on all of them
            votes["_saves_written"] = torch.full((), float(written), device=self._device)
        return votes

    def count_stop_votes(self, metrics: dict[str, float], signals: "StopSignals") -> None:
        written = metrics.pop("_saves_written", None)
        super().count_stop_votes(metrics, signals)
        if written == self._trainer.ranks.world_size:
            self.saves.finish()  # every rank's write is done: hash, manifest, rename


def strategy_for(trainer: ModelOwner, find_unused: bool, strategy: str = "auto",
                 several: bool = False) -> SingleProcess:
    """The strategy for this launch: trainer.strategy, where auto is DataParallel under
    torchrun, else SingleProcess. `several`: build_optimizer named several optimizers."""
    if strategy == "fsdp":
        return FullyShardedDataParallel(trainer)
    if strategy == "ddp" and trainer.ranks.world_size == 1:
        raise ConfigError("trainer.strategy=ddp needs a torchrun job of 2 or more processes; "
                          "this process was not launched by torchrun (or with one process). "
                          "Launch with torchrun --nproc_per_node=N, or set trainer.strategy=auto.")
    if trainer.ranks.world_size > 1:
        return DataParallel(trainer, find_unused, several)
    return SingleProcess()
