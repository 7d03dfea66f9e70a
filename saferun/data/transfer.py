"""Batches to the device and outputs to the host: every tensor in a nested batch (tuples, lists,
dicts, dataclasses), with errors that name the tensor's place in the batch."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from operator import attrgetter, methodcaller
from typing import Any, Callable

import torch

from ..errors import SaferunError

_TENSOR = {torch.Tensor}  # a batch's element types, for the hot path's check (no generator)
_PLAIN = frozenset({str, bytes, int, float, bool, type(None)})  # leaves kept as they are
_IS_CPU = attrgetter("is_cpu")
_function_modes = torch._C._is_torch_function_mode_enabled


def move_to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor in a nested batch (tuples, lists, dicts, dataclasses) to `device`.

    Objects with their own `.to(device)` are moved with it; other leaves (ints,
    strings, None) pass through. Containers keep their type: a dict subclass its
    extra state (a defaultdict's factory), a dataclass its other attributes (it is
    copied and its fields replaced, without running `__init__`/`__post_init__` again).
    A NumPy array or a tensor that fails to move raises `SaferunError` naming its
    place in the batch.
    """
    if type(batch) in (list, tuple) and set(map(type, batch)) == _TENSOR:
        # On the CPU each .to() returns the tensor itself (about 5,000 instructions): skipped,
        # unless a torch function mode is on to see the moves (saferun's host-sync counter
        # treats a moved tensor as on the device, as it would be on a GPU). A list is still a
        # new one, as on a GPU: a training_step that rewrites it (batch[0] = x / 255) must not
        # rewrite the list a loader keeps and yields again.
        if device.type == "cpu" and not _function_modes() and all(map(_IS_CPU, batch)):
            return batch if type(batch) is tuple else batch.copy()
        try:  # the common (inputs, targets) batch, without building a path per element
            moved = list(map(methodcaller("to", device, non_blocking=non_blocking), batch))
            return moved if type(batch) is list else tuple(moved)
        except (RuntimeError, TypeError):
            pass  # the walk below names the tensor that failed

    def tensor(t: torch.Tensor, path: str) -> torch.Tensor:
        try:
            return t.to(device, non_blocking=non_blocking)
        except (RuntimeError, TypeError) as e:
            raise SaferunError(
                f"cannot move {path} (tensor of dtype {t.dtype}, shape {tuple(t.shape)}) "
                f"to {device}: {e}. Return a supported dtype from the dataset or collate_fn."
            ) from None

    def other(obj: Any, path: str) -> Any:
        if type(obj).__module__ == "numpy":
            raise SaferunError(
                f"{path} is a {type(obj).__module__}.{type(obj).__name__}, which cannot be moved "
                f"to {device}. Return torch tensors from the dataset (torch.from_numpy) or the "
                f"collate_fn.")
        to = getattr(obj, "to", None)
        return to(device, non_blocking=non_blocking) if callable(to) else obj

    return _map_tensors(batch, tensor, other, "batch")


def to_host(outputs: Any) -> Any:
    """`outputs` with every tensor on the CPU as a normal tensor (inference tensors are
    cloned, so that the caller can use them in autograd); other leaves pass through."""

    def tensor(t: torch.Tensor, path: str) -> torch.Tensor:
        t = t.detach().cpu()
        return t.clone() if t.is_inference() else t

    def other(obj: Any, path: str) -> Any:
        to = getattr(obj, "to", None)
        if callable(to) and type(obj).__module__ != "numpy":
            return to(torch.device("cpu"))
        return obj

    return _map_tensors(outputs, tensor, other, "output")


def _map_tensors(obj: Any, tensor: Callable[[torch.Tensor, str], Any],
                 other: Callable[[Any, str], Any], path: str) -> Any:
    """`obj` rebuilt with `tensor(t, path)` for each tensor and `other(x, path)` for each leaf
    that is neither a tensor, a plain value nor a container."""
    if isinstance(obj, torch.Tensor):
        return tensor(obj, path)
    if isinstance(obj, (str, bytes, int, float, bool, type(None))):
        return obj
    if isinstance(obj, dict):
        if type(obj) is dict:
            return {k: _map_tensors(v, tensor, other, f"{path}[{k!r}]") for k, v in obj.items()}
        out = copy.copy(obj)  # keeps a subclass's own state (defaultdict's default_factory)
        for k, v in obj.items():
            out[k] = _map_tensors(v, tensor, other, f"{path}[{k!r}]")
        return out
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_map_tensors(v, tensor, other, f"{path}.{f}")
                           for f, v in zip(obj._fields, obj)))
    if type(obj) in (list, tuple) and _PLAIN.issuperset(map(type, obj)):
        return type(obj)(obj)  # plain values only (an RNG state's 625 ints): no call per value
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, tensor, other, f"{path}[{i}]") for i, v in enumerate(obj))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        # Not dataclasses.replace: it would run __init__ and __post_init__ again and reset
        # the init=False fields. A shallow copy with each field replaced keeps everything.
        copied = copy.copy(obj)
        for f in dataclasses.fields(obj):
            if hasattr(obj, f.name):
                object.__setattr__(copied, f.name, _map_tensors(getattr(obj, f.name), tensor, other,
                                                             f"{path}.{f.name}"))
        return copied
    return other(obj, path)


def batch_size_of(batch: Any) -> int:
    """The size of the first dimension of the first tensor in `batch` that has one (a 0-dim
    tensor, such as a per-batch weight beside the inputs, is not a count of samples); 1 for a
    batch of 0-dim tensors only, 0 if it holds no tensor."""
    if type(batch) in (list, tuple) and batch and type(batch[0]) is torch.Tensor and batch[0].dim():
        return batch[0].shape[0]  # the common (inputs, targets) batch, without the walk
    n = _rows(batch)
    return n if n >= 0 else 1


def _rows(batch: Any) -> int:
    """`batch_size_of`, but -1 where only 0-dim tensors were found."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() > 0 else -1
    if isinstance(batch, (list, tuple)):
        items: Any = batch
    elif isinstance(batch, Mapping):  # a dict, or a UserDict (transformers' BatchEncoding)
        items = batch.values()
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        items = (getattr(batch, f.name) for f in dataclasses.fields(batch))
    else:
        return 0
    scalars = 0
    for item in items:
        n = _rows(item)
        if n > 0:
            return n
        scalars = scalars or n
    return scalars


def samples_in(batch: Any, batch_size: Callable[[Any], int], where: str) -> int:
    """`batch_size(batch)` (the Trainer's hook), refused unless positive: `where`'s weights
    (accumulated losses, validation means) are shares of the samples, and 0 would silently
    sum the micro-batches' losses or drop the validation metrics. A whole number of another
    type (a NumPy integer, a 0-dim tensor) is returned as an int: kept as is, it reached the
    checkpoint's samples_seen, which a safe load refuses."""
    n = batch_size(batch)
    count = _whole(n)
    if count is None or not count > 0:
        move_to_device(batch, torch.device("cpu"), False)  # a batch it cannot move says why
        empty: list[str] = []  # tensors of 0 rows: an empty batch, not one saferun cannot count
        _map_tensors(batch, lambda t, path: empty.append(path) if t.dim() and not len(t) else t,
                     lambda obj, path: obj, "batch")
        raise SaferunError(
            f"{where}: Trainer.batch_size(batch) returned {n!r} for a batch of type "
            f"{type(batch).__name__}" + (
                f", which holds no samples ({', '.join(empty[:3])} of 0 rows: a collate_fn or "
                f"sampler that dropped every sample? Give each batch at least one)"
                if count == 0 and empty else "") + f"; it must be the positive number of samples, by which saferun "
            f"weighs {'each micro-batch' if 'micro' in where else 'each batch'} and counts the "
            f"samples seen (samples_seen, perf/samples_per_sec). The default "
            f"counts the first dimension of the first tensor in a tensor, tuple, list, dict or "
            f"dataclass batch; for another batch type, override batch_size(batch) in your "
            f"Trainer.")
    return count


def _whole(n: Any) -> Any:
    """`n` as an int if it is a whole number (an int, a NumPy integer, an integral float or a
    one-element tensor; not a bool), else None."""
    if isinstance(n, bool) or isinstance(n, torch.Tensor) and n.numel() != 1:
        return None
    try:
        whole = int(n)
    except (TypeError, ValueError, OverflowError):
        return None
    return whole if whole == n else None
