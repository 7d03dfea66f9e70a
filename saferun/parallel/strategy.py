"""The parallel strategy: everything that parallelism changes in a run, owned by one object
chosen for the launch (`strategy_for`) and called by the loop at named points, so that the loop
reads the same in one process and under torchrun.

- `data`: the data-parallel ranks (`distributed.Ranks`): the loaders split the data over them, the
  metrics are reduced over them (`data.group`). Under DDP and FSDP every rank; under a device
  mesh its data dimension (the ranks of one tensor-parallel group see the same batches).
- `prepare(model)`: in setup, before the optimizer is built: the model made ready in place
  (FSDP: sharded with `fully_shard`; a mesh: the task's `parallelize(model, mesh)`, then sharded).
- `finish_setup(val_loader, several, train_loader, metrics)`: at the end of setup, with the
  loaders, optimizers and stateful metrics built (DDP: its wrapper, see `GradientSync`, with
  several optimizers each averaging its own gradients; FSDP: every rank validates on as many
  batches; a mesh: also no stream or torchmetrics with tensor parallel).
- `micro_batch(last)`: around each micro-batch's forward and backward (DDP: the wrapped model
  and the gradient average after the last micro-batch's backward).
- `after_evaluation(model)`: after each evaluation pass (FSDP: the parameters put back in
  their shards).
- `gather(obj)`: at a checkpoint, each rank's own state (RNG, pending metrics) onto rank 0.
- `average(named, step)`: several optimizers (`loop/manual.py`), after each optimize()'s backward.
- `agreement`: how the ranks agree on the loop's next move at log points and after each step
  (`agreement.py`: `LocalAgreement` in one process, `RankAgreement` under torchrun).
- `checkpoint_format`: how a checkpoint holds the model and optimizer state
  (`checkpoint/formats.py`: `WholeState`, or `ShardedState` per rank).
- `sharded`: each rank holds a part of the model, so a forward needs every rank.

`SingleProcess` does the least at each point; `DataParallel` is DDP (`ddp.py`);
`FullyShardedDataParallel` is FSDP2 (`fsdp.py`); `MeshParallel` is a device mesh (`mesh.py`: the
task's plan, tensor parallel, then FSDP2 over the data dimension). Each refuses, naming the key,
what it cannot do right. A new strategy is a class here (and its line in `strategy_for`), its
trainer.strategy literal in `config.py` and, if it has options, its settings node in
`config.py` (held by `config.TrainerConfig`).
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Iterator, Optional, Protocol

import torch
from torch import nn

from ..checkpoint.formats import CheckpointFormat, ShardedState, WholeState
from ..errors import ConfigError
from .. import distributed
from . import ddp, fsdp, mesh
from .agreement import LocalAgreement, MeshAgreement, RankAgreement

_NO_CONTEXT = contextlib.nullcontext()  # reusable; cheaper than a generator per micro-batch


class ModelHolder(Protocol):
    """Where training_step finds `self.model`, and the task's parallel plan (the Trainer; a
    Protocol: no import of it)."""

    model: nn.Module

    def parallelize(self, model: nn.Module, mesh: Any) -> nn.Module: ...


class Strategy:
    """The points the loop calls, each doing the least (as in one process)."""

    sharded = False  # each rank holds a part of the model: a forward needs every rank
    agreement: LocalAgreement
    checkpoint_format: CheckpointFormat
    data = distributed.Ranks()  # the data-parallel ranks (one process: rank 0 of 1)
    meshes = False  # the parameters may lie on several device meshes (norms taken per mesh)
    layout: tuple[int, int] = (1, 1)  # (data-parallel ranks, ranks): a checkpoint records it

    def prepare(self, model: nn.Module) -> None:
        """In setup, before the optimizer is built: make `model` ready in place."""

    def finish_setup(self, val_loader: Any, several: bool, train_loader: Any = None,
                     metrics: Any = ()) -> None:
        """At the end of setup. `several`: build_optimizer named several optimizers."""

    def micro_batch(self, last: bool) -> ContextManager[None]:
        return _NO_CONTEXT

    @property
    def wraps_micro_batch(self) -> bool:
        """Whether `micro_batch` does anything (after setup): if not, the step frame
        (loop/frame.py) does not enter it."""
        return type(self).micro_batch is not Strategy.micro_batch

    def after_evaluation(self, model: nn.Module) -> None:
        """After an evaluation pass over `model` (the trained model or its average)."""

    def gather(self, obj: Any) -> Optional[list[Any]]:
        return distributed.gather(obj)

    def average(self, named: list[tuple[str, torch.nn.Parameter]], step: int) -> None:
        """Several optimizers (loop/manual.py): after one optimizer's backward, its gradients
        averaged over ranks. One process: nothing to do."""


class SingleProcess(Strategy):
    """One process: nothing wrapped, every request acts at once, whole checkpoints."""

    def __init__(self) -> None:
        self.agreement = LocalAgreement()
        self.checkpoint_format = WholeState(main=True)


class DataParallel(Strategy):
    """Under torchrun, every rank holds the whole model; gradients are averaged once per
    optimizer step, and every control-flow decision is agreed across ranks.

    It holds the Trainer (a narrow reference: `ModelHolder`) to put the DDP wrapper in
    `trainer.model` while training_step runs, so that user code calling `self.model(...)`
    goes through DDP.
    """

    def __init__(self, find_unused: bool, ranks: distributed.Ranks, device: torch.device,
                 state: Any, holder: ModelHolder) -> None:
        """`state`: the LoopState (the step, for GradientSync's messages)."""
        if ranks.world_size == 1:
            raise ConfigError("trainer.strategy=ddp needs a torchrun job of 2 or more processes; "
                              "this process was not launched by torchrun (or with one process). "
                              "Launch with torchrun --nproc_per_node=N, or set trainer.strategy=auto.")
        self.data, self.layout = ranks, (ranks.world_size, ranks.world_size)
        self.agreement = RankAgreement(device, ranks.world_size)
        self.checkpoint_format = WholeState(main=ranks.is_main)
        self._find_unused, self._device, self._state, self._holder = find_unused, device, state, holder
        self._module: nn.Module = None  # type: ignore[assignment]  # by prepare()
        self._sync: ddp.GradientSync = None  # type: ignore[assignment]  # by finish_setup()

    def prepare(self, model: nn.Module) -> None:
        """Nothing yet: the wrapper is built in `finish_setup`, over the model as setup leaves
        it (the trainable parameters final, compiled if trainer.compile)."""
        self._module = model

    def finish_setup(self, val_loader: Any, several: bool, train_loader: Any = None,
                     metrics: Any = ()) -> None:
        """The DDP wrapper (its constructor makes rank 0's weights everyone's); `several`:
        each optimize() averages its own optimizer's gradients."""
        self._sync = ddp.GradientSync(self._module, self._device, self._find_unused,
                                      manual=several)

    @contextlib.contextmanager
    def micro_batch(self, last: bool) -> Iterator[None]:
        """Average the gradients over ranks once per optimizer step, after the last
        micro-batch's backward, whatever training_step calls (see GradientSync)."""
        holder = self._holder
        module, holder.model = holder.model, self._sync.model  # the DDP wrapper, unless bypassed
        try:
            with self._sync.micro_batch(last, self._state.step + 1):
                yield
        finally:
            holder.model = module

    def average(self, named: list[tuple[str, torch.nn.Parameter]], step: int) -> None:
        """Several optimizers: each optimize() averages its own optimizer's gradients."""
        ddp.average_gradients(named, self._sync.find_unused, step)


class FullyShardedDataParallel(Strategy):
    """Under torchrun with trainer.strategy=fsdp: the model sharded (FSDP2), gradients
    reduce-scattered once per optimizer step (see `fsdp.ShardedSync`), checkpoints written per
    rank (`ShardedState`); every control-flow decision agreed across ranks as under DDP."""

    sharded = True

    def __init__(self, t: Any, ranks: distributed.Ranks, device: torch.device, state: Any) -> None:
        """`t`: the trainer config (trainer.fsdp's settings); `state`: the LoopState."""
        fsdp.check(t, ranks, device)  # before anything is built
        self.data, self.layout = ranks, (ranks.world_size, ranks.world_size)
        self.agreement = RankAgreement(device, ranks.world_size)
        self.checkpoint_format = ShardedState(t.fsdp.async_save, self.agreement)
        self._t, self._ranks, self._device, self._state = t, ranks, device, state
        self._sync: fsdp.ShardedSync = None  # type: ignore[assignment]  # by prepare()

    def prepare(self, model: nn.Module) -> None:
        """`fully_shard` the model in place (refused, naming the key, where it cannot be)."""
        fsdp.shard_model(model, self._t, self._ranks, self._device)
        self._sync = fsdp.ShardedSync(model)

    def finish_setup(self, val_loader: Any, several: bool, train_loader: Any = None,
                     metrics: Any = ()) -> None:
        fsdp.check_even_evaluation(val_loader, self._t.limit_val_batches)

    def micro_batch(self, last: bool) -> ContextManager[None]:
        return self._sync.micro_batch(last, self._state.step + 1)

    def after_evaluation(self, model: nn.Module) -> None:
        """An evaluation forward leaves the root's parameters gathered: put them back in their
        shards (every unit's)."""
        fsdp.reshard(model)


class MeshParallel(Strategy):
    """Under torchrun with trainer.strategy=mesh: the ranks laid out on a device mesh of
    trainer.parallel's shape (dp_shard x tp); the task's `parallelize(model, mesh)` applies its
    plan (tensor parallel over the mesh's "tp" dimension), then, with dp_shard > 1, FSDP2
    shards the model over the "dp_shard" dimension. The data is split over "dp_shard" only
    (`data`), the metrics reduced over it; every control-flow decision is agreed over all
    ranks; checkpoints are written per rank (`ShardedState`)."""

    sharded = meshes = True

    def __init__(self, t: Any, ranks: distributed.Ranks, device: torch.device, state: Any,
                 holder: ModelHolder) -> None:
        self._layout = mesh.Layout.of(t, ranks, device)  # refused, naming the key, before anything
        self.mesh = self._layout.device_mesh(device)
        self.data = self._layout.data_ranks(self.mesh, ranks)
        self.layout = (self.data.world_size, ranks.world_size)
        self.agreement = MeshAgreement(device, ranks.world_size)
        self.checkpoint_format = ShardedState(t.fsdp.async_save, self.agreement)
        self._t, self._ranks, self._device, self._state, self._holder = t, ranks, device, state, holder
        self._sync: Optional[fsdp.ShardedSync] = None  # by prepare(), with dp_shard > 1

    def prepare(self, model: nn.Module) -> None:
        """The task's plan (`parallelize`), then FSDP2 over the data dimension."""
        mesh.apply_plan(self._holder, model, self.mesh, self._layout)
        if self._layout.dp_shard > 1:
            fsdp.shard_model(model, self._t, self._ranks, self._device,
                             self.mesh[mesh.DP])
            self._sync = fsdp.ShardedSync(model)

    def finish_setup(self, val_loader: Any, several: bool, train_loader: Any = None,
                     metrics: Any = ()) -> None:
        fsdp.check_even_evaluation(val_loader, self._t.limit_val_batches)
        mesh.check_data(self._layout, train_loader, metrics)

    def micro_batch(self, last: bool) -> ContextManager[None]:
        if self._sync is None:
            return _NO_CONTEXT
        return self._sync.micro_batch(last, self._state.step + 1)

    @property
    def wraps_micro_batch(self) -> bool:
        return self._sync is not None  # dp_shard > 1: FSDP2's gradient sync

    def after_evaluation(self, model: nn.Module) -> None:
        fsdp.reshard(model)


def strategy_for(t: Any, ranks: distributed.Ranks, device: torch.device, state: Any,
                 holder: ModelHolder) -> Strategy:
    """The strategy for this launch: trainer.strategy (`t`: the trainer config), where auto is
    DataParallel under torchrun, else SingleProcess. `state`: the LoopState; `holder`: where
    training_step finds self.model."""
    if t.strategy == "fsdp":
        return FullyShardedDataParallel(t, ranks, device, state)
    if t.strategy == "mesh":
        return MeshParallel(t, ranks, device, state, holder)
    if t.strategy == "ddp" or ranks.world_size > 1:
        return DataParallel(t.find_unused_parameters, ranks, device, state, holder)
    return SingleProcess()
