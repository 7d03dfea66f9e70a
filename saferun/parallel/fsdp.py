"""trainer.strategy=fsdp: the model sharded over the ranks with FSDP2 (`fully_shard`).

Each rank holds 1/N of every parameter, gradient and optimizer state (as DTensors). Before a
unit's forward its parameters are all-gathered, after its backward the gradients are
reduce-scattered (averaged) into the shards, so the optimizer steps on the shards only. The
units are the submodules named by `trainer.fsdp.shard` (default: each block of a stack of
like blocks) plus the root, which holds what is left.

What saferun adds, so that the loop's guarantees hold as under DDP (see `ShardedSync`): the
reduce-scatter skipped on every micro-batch but the last, a training_step that bypasses
`self.model(...)` refused with the reason (it fails with torch's bare DTensor error otherwise),
rank 0's buffers broadcast after each step, and the parameters resharded after evaluation
(an evaluation forward leaves the root gathered: no backward reshards it).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

import torch
from torch import nn

from ..errors import ConfigError, SaferunError
from .. import distributed

_MIXED = "got mixed torch.Tensor and DTensor"  # torch's error for a gathered-less parameter


def is_sharded(module: nn.Module) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing is sharded
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


def check(t: Any, ranks: distributed.Ranks, device: torch.device) -> None:
    """Refuse, naming the key, what trainer.strategy=fsdp cannot do right."""
    if ranks.world_size == 1:
        raise ConfigError("trainer.strategy=fsdp shards the model over the processes of a "
                          "torchrun job, and this process was not launched by torchrun (or with "
                          "one process). Launch with torchrun --nproc_per_node=N (N >= 2), or "
                          "set trainer.strategy=auto.")
    if t.compile:
        raise ConfigError("trainer.compile=true with trainer.strategy=fsdp: saferun checks a "
                          "compiled model against eager on one process, which it cannot do for "
                          "a sharded one, and does not run an unchecked compiled model. Set "
                          "trainer.compile=false (or use trainer.strategy=ddp).")
    if t.find_unused_parameters:
        raise ConfigError("trainer.find_unused_parameters=true with trainer.strategy=fsdp: "
                          "FSDP2 reduce-scatters every trainable parameter's gradient at every "
                          "step. Freeze what a step does not use (trainer.frozen_modules), or "
                          "use trainer.strategy=ddp.")
    if t.fsdp.cpu_offload and device.type != "cuda":
        raise ConfigError("trainer.fsdp.cpu_offload=true offloads from the GPU to host memory; "
                          "this run trains on the CPU already. Set it to false.")


def shard_model(model: nn.Module, t: Any, ranks: distributed.Ranks, device: torch.device,
                mesh: Any = None) -> None:
    """`fully_shard` the units, then the root, in place (the strategy's `prepare`: before the
    optimizer is built, so that it holds the shards), over `mesh` (a DeviceMesh; None: every
    rank). The strategy refused what cannot be done right (`check`) before."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    f = t.fsdp
    options: dict[str, Any] = {"reshard_after_forward": f.reshard_after_forward, "mesh": mesh}
    if f.param_dtype == "bf16":
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                    reduce_dtype=torch.float32)
    if f.cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    for _, unit in units(model, f.shard):
        fully_shard(unit, **options)
    fully_shard(model, **options)


def units(model: nn.Module, names: list[str]) -> list[tuple[str, nn.Module]]:
    """The submodules sharded as units of their own (see `FSDPConfig.shard`), outermost first."""
    found: list[tuple[str, nn.Module]] = []
    if names:
        modules = dict(model.named_modules())
        for name in names:
            hits = [(n, m) for n, m in modules.items()
                    if n and (n == name or type(m).__name__ == name)]
            if not hits:
                classes = sorted({type(m).__name__ for m in modules.values()})
                raise ConfigError(f"trainer.fsdp.shard: {name!r} is neither a submodule path nor "
                                  f"a class name in the model. Classes: {', '.join(classes)}.")
            found += hits
    else:
        for n, m in model.named_modules():
            children = list(m.children())
            if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(children) > 1 and \
                    len({type(c) for c in children}) == 1 and any(True for _ in m.parameters()):
                found += [(f"{n}.{i}" if n else str(i), c) for i, c in enumerate(children)]
    # a unit inside another is sharded first (fully_shard works inside out): sort deepest first
    unique = {id(m): (n, m) for n, m in found}
    ordered = sorted(unique.values(), key=lambda nm: -nm[0].count("."))
    _refuse_tied_across(ordered)
    return ordered


def _refuse_tied_across(found: list[tuple[str, nn.Module]]) -> None:
    """A parameter shared by two units (tied weights) cannot be sharded by both: FSDP2 fails
    at the first forward with an error that seems to blame training_step. Say so at setup."""
    owner: dict[int, str] = {}
    for name, unit in found:  # deepest first: a parameter belongs to the innermost unit
        inner = {id(p) for n, m in found if n.startswith(name + ".") for p in m.parameters()}
        for pname, p in unit.named_parameters():
            if id(p) in inner:
                continue
            if id(p) in owner and owner[id(p)] != name:
                raise ConfigError(
                    f"trainer.fsdp.shard: the parameter {name}.{pname} is also in unit "
                    f"{owner[id(p)]} (tied weights), and FSDP2 can shard a parameter in one unit "
                    f"only. Shard units that do not share it (leave the modules that tie it to "
                    f"the root unit), or untie the weights.")
            owner[id(p)] = name


class ShardedSync:
    """Around each micro-batch's forward and backward under FSDP2 (the strategy's `micro_batch`)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._syncing = True  # FSDP2's default: reduce-scatter after every backward
        self._forwarded = [False]
        model.register_forward_pre_hook(lambda *_: self._forwarded.__setitem__(0, True))
        self._has_buffers = any(True for _ in model.buffers())

    @contextlib.contextmanager
    def micro_batch(self, last: bool, step: int) -> Iterator[None]:
        if self._syncing != last:  # accumulation: gradients stay unsharded until the last one
            self.model.set_requires_gradient_sync(last)  # type: ignore[operator]
            self._syncing = last
        self._forwarded[0] = False
        try:
            yield
        except RuntimeError as e:
            if _MIXED in str(e) and not self._forwarded[0]:
                raise self._bypassed(step) from e
            raise
        if not self._forwarded[0]:
            raise self._bypassed(step)
        if last and self._has_buffers:
            distributed.broadcast_buffers(self.model)  # one model for evaluation and saving

    @staticmethod
    def _bypassed(step: int) -> SaferunError:
        return SaferunError(
            f"step {step}: training_step did not call self.model(...), which "
            f"trainer.strategy=fsdp needs: FSDP2 gathers the sharded parameters in the forward "
            f"of the model and of each unit, so calling submodules directly "
            f"(self.model.head(...)) computes on shards, or skips the gradient reduction. Call "
            f"self.model(...) (give the model a forward that does what training_step needs), or "
            f"use trainer.strategy=ddp.")


def reshard(model: nn.Module) -> None:
    """Put the parameters back in their shards after an evaluation forward: every unit's (with
    reshard_after_forward=false the units stay gathered too; reshard() acts on one unit)."""
    if is_sharded(model):
        for module in model.modules():
            if is_sharded(module):
                module.reshard()  # type: ignore[operator]


def check_even_evaluation(loader: Any, limit: Any) -> None:
    """Under fsdp every forward all-gathers parameters, a collective: a rank with one more
    validation batch than another would meet the other's metric reduction with a forward's
    all-gather. Refuse at setup, with the counts, when the ranks' batch counts differ."""
    if loader is None:
        return
    try:
        mine = len(loader)
    except TypeError:  # an iterable dataset: its length is unknown before the pass
        return
    mine = mine if limit is None else min(mine, limit)
    every: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, mine)
    if len(set(every)) > 1:
        raise ConfigError(
            f"trainer.strategy=fsdp: the ranks get {every} validation batches (rank 0, 1, ...), "
            f"but every FSDP forward is a collective, so all ranks must run as many. Choose "
            f"trainer.val_batch_size (or the validation set's size) so that every rank's share "
            f"splits into the same number of batches (e.g. len(val) divisible by world size x "
            f"val_batch_size), or set trainer.limit_val_batches to at most {min(every)}.")
