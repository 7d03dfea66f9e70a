"""What a DataLoader's workers receive, walked as pickling would: the object graph (`children`)
and the random generator objects inside it, which workers copy without reseeding.

Random generator objects stored on the dataset are copied into every worker as they are:
workers reseed Python's `random`, NumPy's global RNG and torch's default generator, but not
these, so every worker (and every epoch, unless workers persist) repeats the same draws. A
`torch.Generator` also crashes spawn and forkserver workers while they unpickle it.
"""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.connection
import multiprocessing.queues
import multiprocessing.sharedctypes
import multiprocessing.synchronize
import random
import types
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import numpy as np
import torch
from torch import nn

MAX_DEPTH = 30
_MAX_ITEMS = 1000  # items looked at per container when scanning for generators

# Pickled as handles when a process is spawned; outside a spawn they refuse to pickle.
MP_SHARED = (
    multiprocessing.synchronize.Lock, multiprocessing.synchronize.RLock,
    multiprocessing.synchronize.Semaphore, multiprocessing.synchronize.BoundedSemaphore,
    multiprocessing.synchronize.Condition, multiprocessing.synchronize.Event,
    multiprocessing.synchronize.Barrier, multiprocessing.queues.Queue,
    multiprocessing.queues.JoinableQueue, multiprocessing.queues.SimpleQueue,
    multiprocessing.sharedctypes.Synchronized, multiprocessing.sharedctypes.SynchronizedArray,
    multiprocessing.sharedctypes.SynchronizedString, multiprocessing.connection.Connection,
)
_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None), torch.Tensor,
           np.ndarray, np.generic, type, types.ModuleType, types.FunctionType,
           types.BuiltinFunctionType, torch.device, torch.dtype)

_FIX_RNG = ("draw from the global RNGs (random, np.random, torch), which DataLoader and saferun "
            "seed differently in every worker, or create the generator in each worker from "
            "torch.utils.data.get_worker_info().seed (in worker_init_fn, or lazily in "
            "__getitem__)")


@dataclass(frozen=True)
class Finding:
    """One offending object: where it is, what it is, and how to fix it."""

    path: str
    what: str
    fix: str

    def __str__(self) -> str:
        return f"{self.path}: {self.what}. Fix: {self.fix}."


def find_rng_objects(obj: Any, name: str = "dataset") -> list[Finding]:
    """Name the random generator objects stored inside `obj`, which workers do not reseed.

    Looks for `numpy.random.Generator`, `numpy.random.RandomState`,
    `torch.Generator` and `random.Random` instances (the global ones, which
    workers do reseed, are not reported). Containers are sampled: the first
    1000 items of each list, tuple or dict.
    """
    found: list[tuple[Finding, Any]] = []
    scan_rng(obj, name, found, set(), 0)
    return [f for f, _ in found]


def rng_objects(obj: Any, name: str, skip: tuple[Any, ...] = ()) -> list[tuple[str, Any]]:
    """(attribute path, generator) for each generator object `find_rng_objects` would name,
    not looking inside the objects in `skip` (e.g. the dataset a sampler refers to)."""
    found: list[tuple[Finding, Any]] = []
    scan_rng(obj, name, found, {id(o) for o in skip}, 0)
    return [(f.path, rng) for f, rng in found]


def rng_kind(obj: Any) -> Optional[str]:
    """'a numpy.random.Generator' (etc.) for a generator object other than the global ones."""
    if isinstance(obj, np.random.Generator):
        return "a numpy.random.Generator"
    if isinstance(obj, np.random.RandomState) and obj is not np.random.mtrand._rand:
        return "a numpy.random.RandomState"
    if isinstance(obj, torch.Generator) and obj is not torch.default_generator:
        return "a torch.Generator"
    if (isinstance(obj, random.Random) and not isinstance(obj, random.SystemRandom)
            and obj is not getattr(random, "_inst", None)):
        return "a random.Random"
    return None


def scan_rng(obj: Any, path: str, found: list[tuple[Finding, Any]], seen: set[int],
              depth: int) -> None:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    kind = rng_kind(obj)
    if kind is not None:
        found.append((Finding(path, f"{kind}, which DataLoader workers do not reseed", _FIX_RNG),
                      obj))
        return
    if depth < MAX_DEPTH:
        for i, (suffix, child) in enumerate(children(obj)):
            if i == _MAX_ITEMS:
                break
            scan_rng(child, path + suffix, found, seen, depth + 1)


def children(obj: Any) -> Iterator[tuple[str, Any]]:
    """(path suffix, child) for what pickling an object would include."""
    if isinstance(obj, np.ndarray) and obj.dtype == object:
        for i, v in enumerate(obj.flat):
            yield f".flat[{i}]", v
        return
    if isinstance(obj, _LEAVES) or isinstance(obj, MP_SHARED):
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield f"[{k!r}]", v
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield f"[{i}]", v
    elif isinstance(obj, functools.partial):
        yield ".func", obj.func
        for i, v in enumerate(obj.args):
            yield f".args[{i}]", v
        for k, v in obj.keywords.items():
            yield f".keywords[{k!r}]", v
    elif isinstance(obj, types.MethodType):
        yield ".__self__", obj.__self__
    else:
        attrs = getattr(obj, "__dict__", None)
        if isinstance(attrs, dict):
            for k, v in attrs.items():
                if k == "_modules" and isinstance(obj, nn.Module):
                    for child_name, child in v.items():  # name submodules as model.child
                        yield f".{child_name}", child
                else:
                    yield f".{k}", v
        for slot in _slots(type(obj)):
            try:
                yield f".{slot}", getattr(obj, slot)
            except AttributeError:
                pass


def _slots(cls: type) -> list[str]:
    names = []
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for s in [slots] if isinstance(slots, str) else slots:
            if s not in ("__dict__", "__weakref__"):
                names.append(s)
    return names
