"""trainer.strategy=mesh: the ranks of a torchrun job laid out on a 2-D device mesh
(`trainer.parallel`: dp_shard x tp, the data dimension first, so that one tensor-parallel
group is on neighbouring ranks, on one host).

The task's `Trainer.parallelize(model, mesh)` applies its plan in place (tensor parallel over
`mesh["tp"]`, with torch.distributed.tensor.parallel); then, with dp_shard > 1, FSDP2 shards the
model over `mesh["dp_shard"]` (`fsdp.shard_model`). The ranks of one tensor-parallel group see
the same batches: the data is split over "dp_shard" only (the strategy's `data`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import IterableDataset

from ..errors import ConfigError
from .. import distributed
from . import fsdp

DP, TP = "dp_shard", "tp"  # the mesh's dimension names


@dataclass(frozen=True)
class Layout:
    """The mesh's shape, checked against the job."""

    dp_shard: int
    tp: int

    @classmethod
    def of(cls, t: Any, ranks: distributed.Ranks, device: torch.device) -> "Layout":
        """trainer.parallel's shape for this job; refused, naming the key, where it does not fit
        or where the loop cannot be right on it."""
        p = t.parallel
        if ranks.world_size == 1:
            raise ConfigError("trainer.strategy=mesh lays the processes of a torchrun job out on a "
                              "device mesh, and this process was not launched by torchrun (or with "
                              "one process). Launch with torchrun --nproc_per_node=N (N >= 2), or "
                              "set trainer.strategy=auto.")
        dp = p.dp_shard if p.dp_shard is not None else ranks.world_size // p.tp
        if dp * p.tp != ranks.world_size:
            raise ConfigError(
                f"trainer.parallel: dp_shard={p.dp_shard} x tp={p.tp} must be the number of "
                f"processes, {ranks.world_size}. Set trainer.parallel.tp to a divisor of "
                f"{ranks.world_size} and dp_shard to null (the rest), or launch "
                f"dp_shard x tp processes.")
        if dp > 1:
            fsdp.check(t, ranks, device)  # the data dimension is FSDP2's: its refusals hold
        elif t.compile or t.find_unused_parameters:
            key = "trainer.compile" if t.compile else "trainer.find_unused_parameters"
            raise ConfigError(f"{key} with trainer.strategy=mesh: not supported on a device mesh "
                              f"(as with trainer.strategy=fsdp). Turn it off.")
        return cls(dp, p.tp)

    def device_mesh(self, device: torch.device) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device.type, (self.dp_shard, self.tp), mesh_dim_names=(DP, TP))

    def data_ranks(self, mesh: Any, ranks: distributed.Ranks) -> distributed.Ranks:
        """This rank's place in the data dimension, whose group the metrics are reduced over."""
        return distributed.Ranks(mesh.get_local_rank(DP), self.dp_shard, ranks.local_rank,
                                 mesh.get_group(DP))


def apply_plan(holder: Any, model: nn.Module, mesh: Any, layout: Layout) -> None:
    """The task's `parallelize(model, mesh)`, checked: the model changed in place, and with
    tp > 1 split (some parameter a DTensor), else every rank of a tensor-parallel group would
    compute the whole model on the same batch, silently."""
    out = holder.parallelize(model, mesh)
    name = type(holder).__name__
    if out is not model:
        raise ConfigError(f"{name}.parallelize(model, mesh) returned "
                          f"{type(out).__name__ if out is not None else 'None'}, not the model it "
                          f"was given: apply the plan in place and return the model "
                          f"(parallelize_module does both).")
    if layout.tp > 1 and not any(distributed.is_dtensor(p) for p in model.parameters()):
        raise ConfigError(f"trainer.parallel.tp={layout.tp}, but {name}.parallelize(model, mesh) "
                          f"split no parameter over mesh[\"tp\"]: the ranks of each tensor-parallel "
                          f"group would all compute the whole model. Override parallelize with "
                          f"the model's plan (docs/distributed.md), or set trainer.parallel.tp=1.")


def check_data(layout: Layout, train_loader: Any, metrics: Any) -> None:
    """With tp > 1, refuse what would split or reduce over every rank instead of the data
    dimension: a stream that splits itself by global rank (`ShardedStream`, `shard_index`), and
    torchmetrics objects, which sync over every rank (each group's state tp times)."""
    if layout.tp == 1:
        return
    if train_loader is not None and isinstance(train_loader.dataset, IterableDataset):
        raise ConfigError(
            f"trainer.parallel.tp={layout.tp} with a training stream ({type(train_loader.dataset).__name__}, "
            f"an IterableDataset): a stream splits itself by global rank, so the ranks of one "
            f"tensor-parallel group would read different batches. Use a map-style Dataset "
            f"(saferun splits it over the data dimension), or trainer.parallel.tp=1.")
    if metrics:
        raise ConfigError(
            f"trainer.parallel.tp={layout.tp} with build_metrics() ({', '.join(metrics)}): "
            f"torchmetrics syncs over every rank, counting each tensor-parallel group's samples "
            f"tp times. Return the values from validation_step instead (saferun reduces them over "
            f"the data dimension), or set trainer.parallel.tp=1.")
