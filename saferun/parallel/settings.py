"""The settings of the parallel strategies (`trainer.fsdp`, `trainer.parallel`), kept beside the code that reads
them; `config.TrainerConfig` holds them as a node."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..errors import ConfigError


@dataclass
class FSDPConfig:
    """trainer.strategy=fsdp: how FSDP2 (`fully_shard`) shards the model (docs/distributed.md)."""

    shard: list[str] = field(default_factory=list)
    """Submodules sharded as units of their own, by class name (Block) or path (blocks.0);
    the root is always one. Empty: each child of a ModuleList/Sequential whose children are
    all of one class (the blocks of a Transformer)."""
    reshard_after_forward: bool = True
    """Free each unit's gathered parameters after its forward (gathered again for backward):
    less memory, one more all-gather per unit per micro-batch."""
    param_dtype: Optional[str] = None
    """bf16: parameters gathered and computed in bf16, gradients reduced in fp32
    (MixedPrecisionPolicy); the sharded parameters and optimizer state stay fp32. null: fp32."""
    cpu_offload: bool = False
    """Keep the sharded parameters, gradients and optimizer state in host memory (CUDA only:
    the optimizer steps on the CPU)."""
    async_save: bool = False
    """Write checkpoints in a background thread (torch.distributed.checkpoint.async_save):
    training goes on after a copy of the state; the checkpoint is completed (manifest,
    rename) at the next log point after every rank's write finished, or the next save."""

    def __post_init__(self) -> None:
        if self.param_dtype not in (None, "bf16", "fp32"):
            raise ConfigError(f"trainer.fsdp.param_dtype must be bf16, fp32 or null; got "
                              f"{self.param_dtype!r}.")


@dataclass
class ParallelConfig:
    """trainer.strategy=mesh: the device mesh's shape, data dimension first (docs/distributed.md)."""

    dp_shard: Optional[int] = None
    """Ranks the data is split over, the model sharded over with FSDP2 (1: not sharded). null:
    the processes left over by tp (world size / tp)."""
    tp: int = 1
    """Ranks of one tensor-parallel group: the task's parallelize(model, mesh) splits each
    layer over mesh["tp"]; they see the same batches."""

    def __post_init__(self) -> None:
        for key in ("dp_shard", "tp"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ConfigError(f"trainer.parallel.{key} must be a positive integer"
                                  f"{' or null' if key == 'dp_shard' else ''}; got {value!r}.")
