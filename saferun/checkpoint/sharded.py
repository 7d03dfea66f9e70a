"""Sharded checkpoints (trainer.strategy=fsdp, the `formats.ShardedState` format), with
torch.distributed.checkpoint (DCP).

A checkpoint directory holds, beside `state.pt` (the loop's state: step, each rank's RNG
states and data position, scheduler, callbacks; written by rank 0 as in one process):
`__<rank>_0.distcp`, each rank's shards of the model and optimizer (from `get_state_dict`)
and of trainer.ema's average (`ShardedWeightAverage`, DTensors like the model's), and
`.metadata`, DCP's index of them. The crash-safety protocol is `store`'s, over all ranks:

1. rank 0 names the temporary directory and every rank learns it;
2. every rank writes its shard file there, flushed and fsynced (DCP's `sync_files`); DCP's
   coordinator (rank 0) writes `.metadata`, fsynced, once every rank's write is done;
3. every rank hashes its own files and sends the hashes to rank 0 (so none is missing);
4. rank 0 writes the manifest listing every file with its SHA-256, renames the directory to
   `step-N` and fsyncs the parent (`store.publish`), then rotates.

With `trainer.fsdp.async_save` step 2 runs in a background thread on a copy of the state
(DCP's staging), so training goes on; steps 3-4 are collectives, run on the main thread at an
agreed point after every rank's write has finished (`finish`): a crash before then leaves a
`.tmp-*` directory, ignored on resume, never a listed checkpoint that is incomplete.

Loading runs nothing from the files: `.metadata` (a pickle) is read with an unpickler that
admits only DCP's metadata classes, and the non-tensor values (the optimizer's param_groups)
with `torch.load(weights_only=True)` instead of DCP's default `weights_only=False`; tensors DCP
reads with `weights_only=True` itself. And only files the manifest's hashes vouch for.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import secrets
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_state_dict)

from .. import distributed
from ..errors import CheckpointError
from .store import LOCAL, Storage, file_digest, publish, write_tensor_file
from .store import _write_failure as write_failure

log = logging.getLogger("saferun")


class ShardedWriter:
    """Writes the sharded checkpoints of one run; at most one asynchronous save in flight."""

    def __init__(self, async_save: bool) -> None:
        self.async_save = async_save
        # DCP's background write gathers over its own group, never interleaved with training's
        self._group = dist.new_group(backend="gloo") if async_save else None
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="saferun-hash") if async_save else None
        self._pending: Optional[tuple[Future, Path, Path, int, Callable[[Path], None]]] = None
        self._storage: Storage = LOCAL  # the last save's

    def save(self, root: Path, step: int, state: dict[str, Any], model: nn.Module,
             optimizer: torch.optim.Optimizer, after: Callable[[Path], None], storage: Storage) -> Path:
        """Every rank: write checkpoint `step` of `state` (Trainer.state_dict) and the shards.
        `after(path)` runs on rank 0 once it is complete (rotation). DCP writes the shards with
        its own FileSystemWriter: `storage` must be the local filesystem's view of them."""
        self.finish()  # the previous one first: checkpoints complete in order
        self._storage = storage
        final = root / f"step-{step:08d}"
        tmp = Path(distributed.broadcast(str(root / f".tmp-step-{step:08d}-{secrets.token_hex(4)}")))
        ema = state.get("ema")  # trainer.ema's average, sharded like the model: with its shards
        state = {k: v for k, v in state.items() if k not in ("model", "optimizer", "ema")}
        # get_state_dict would fake an optimizer step (lr 0) to create state that is not there
        # yet (a step-0 save, a stateless SGD), and change this run's optimizer: then only the
        # param_groups (lr, ...), which are the same on every rank, go into state.pt
        has_optim = bool(optimizer.state)
        state["sharded"] = {"world_size": dist.get_world_size(), "optimizer": has_optim,
                            "param_groups": None if has_optim else
                            optimizer.state_dict()["param_groups"], "ema": ema is not None}
        try:
            storage.makedirs(tmp)
            writer = dcp.FileSystemWriter(str(tmp), sync_files=True, single_file_per_rank=True)
            shards = _shards(model, optimizer if has_optim else None)
            if ema is not None:
                shards["ema"] = ema
            if dist.get_rank() == 0:
                write_tensor_file(tmp / "state.pt", state, storage)
            if self.async_save:
                written = dcp.async_save(shards, storage_writer=writer, process_group=self._group)
                assert self._hasher is not None  # this rank's hashes, also off the training thread
                hashed = self._hasher.submit(lambda: (written.result(), _own_files(tmp, storage))[1])  # type: ignore[union-attr]  # a Future here
                self._pending = (hashed, tmp, final, step, after)
                return final
            dcp.save(shards, storage_writer=writer)
        except (OSError, RuntimeError) as e:
            storage.remove(tmp)
            raise CheckpointError(write_failure(final, e)) from None
        return self._publish(tmp, final, step, after)

    def written(self) -> Optional[bool]:
        """Whether this rank's asynchronous write is done (None: none in flight)."""
        return None if self._pending is None else self._pending[0].done()

    def finish(self) -> None:
        """Every rank: complete the save in flight, if any (waits for its write)."""
        if self._pending is None:
            return
        future, tmp, final, step, after = self._pending
        self._pending = None
        try:
            files = future.result()
        except BaseException as e:
            self._storage.remove(tmp)
            raise CheckpointError(write_failure(final, e)) from e
        self._publish(tmp, final, step, after, files)

    def _publish(self, tmp: Path, final: Path, step: int, after: Callable[[Path], None],
                 files: Optional[dict[str, Any]] = None) -> Path:
        rank, storage = dist.get_rank(), self._storage
        every = distributed.gather(_own_files(tmp, storage) if files is None else files)
        if rank == 0:
            assert every is not None
            listed = {name: entry for part in every for name, entry in part.items()}
            try:
                publish(tmp, final, step, listed, storage)
            except BaseException as e:
                storage.remove(tmp)
                if isinstance(e, OSError):
                    raise CheckpointError(write_failure(final, e)) from None
                raise
            after(final)
        return final


def _own_files(tmp: Path, storage: Storage) -> dict[str, Any]:
    """This rank's written files in `tmp` with their manifest entries (rank 0: also DCP's
    .metadata, written once every rank's write was done, and state.pt)."""
    rank = dist.get_rank()
    mine = sorted(name for name in storage.listdir(tmp) if name.startswith(f"__{rank}_"))
    if rank == 0:
        mine += [".metadata", "state.pt"]
    return {name: dict(zip(("bytes", "sha256"), file_digest(tmp / name, storage))) for name in mine}


def _shards(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> dict[str, Any]:
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def load(path: Path, state: Mapping[str, Any], model: nn.Module,
         optimizer: Optional[torch.optim.Optimizer], ema: Any = None) -> None:
    """Every rank: load the shards of checkpoint `path` (verified by `store.load_checkpoint`)
    into `model` (and `optimizer`, and `ema`: trainer.ema's average), resharded if it was
    written by another number of ranks. A checkpoint without an average starts `ema` from
    the loaded weights."""
    info = state.get("sharded")
    if info is None:
        raise CheckpointError(
            f"{path} was written by trainer.strategy=auto or ddp (whole weights in state.pt) and "
            f"this run shards the model (trainer.strategy=fsdp). Resume with the strategy that "
            f"wrote it.")
    with_optim = optimizer is not None and info["optimizer"]
    with_ema = ema is not None and info.get("ema", False)
    shards = _shards(model, optimizer if with_optim else None)
    if with_ema:
        shards["ema"] = ema.state_dict()  # loaded in place, into this run's shards
    try:
        dcp.load(shards, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner())
    except Exception as e:  # DCP reports a refused .metadata as an AssertionError
        raise CheckpointError(f"could not load the shards of {path}: {e}") from None
    if with_optim:
        set_state_dict(model, optimizer, model_state_dict=shards["model"],  # type: ignore[arg-type]  # with_optim: it is set
                       optim_state_dict=shards["optim"])
    else:
        set_state_dict(model, (), model_state_dict=shards["model"], optim_state_dict={})
    if ema is not None:  # after the model: without an average in the checkpoint, its weights
        ema.load_state_dict(shards["ema"] if with_ema else None)
    if not with_optim and optimizer is not None and info.get("param_groups"):
        for group, saved in zip(optimizer.param_groups, info["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every rank: the whole, unsharded state dict, on the CPU of rank 0 ({} elsewhere)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,  # type: ignore[return-value]  # tensors
                                                                cpu_offload=True))


class SafeReader(dcp.FileSystemReader):
    """DCP's reader, except that `.metadata` is unpickled with only DCP's metadata classes."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        with open(os.path.join(self.path, ".metadata"), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, except that non-tensor values load with weights_only=True."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata",)
_ALLOWED_GLOBALS = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                    ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _ALLOWED_MODULES:  # the classes defined there: dataclasses and enums
            found = super().find_class(module, name)
            if isinstance(found, type) and found.__module__ == module:
                return found
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None),
                                                               (torch.dtype, torch.layout,
                                                                torch.memory_format))):
            return getattr(torch, name)
        if (module, name) in _ALLOWED_GLOBALS:  # a layout by name, the checkpoint's path
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused to unpickle {module}.{name} from a checkpoint's "
                                     f".metadata: only DCP's metadata classes are loaded")
