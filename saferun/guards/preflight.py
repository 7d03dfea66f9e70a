"""DataLoader preflight: check what the workers will receive before they start.

A DataLoader with `num_workers > 0` hands each worker its dataset, collate_fn
and worker_init_fn. Under the `spawn` and `forkserver` start methods they are
pickled (with multiprocessing's ForkingPickler); under `fork` the process is
copied and nothing is pickled. So a lambda in a transform works on Linux
today and crashes on macOS and Windows (spawn) and on Linux from Python 3.14
(forkserver). The sampler and batch_sampler run in the main process and are
never sent to workers, so they need not pickle.

Random generator objects stored on the dataset are copied into every worker
as they are: workers reseed Python's `random`, NumPy's global RNG and torch's
default generator, but not these, so every worker (and every epoch, unless
workers persist) repeats the same draws. A `torch.Generator` also crashes
spawn and forkserver workers while they unpickle it.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import multiprocessing
import multiprocessing.connection
import multiprocessing.queues
import multiprocessing.sharedctypes
import multiprocessing.synchronize
import os
import pickle
import random
import sys
import threading
import types
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any, Iterator, Optional

import numpy as np
import torch
import torch.multiprocessing  # registers the tensor reducers that _Probe replaces
from torch import nn
from torch.utils.data import DataLoader

from ..errors import SaferunError

# What DataLoader passes to each worker process (torch/utils/data/dataloader.py).
SENT_TO_WORKERS = ("dataset", "collate_fn", "worker_init_fn")

_MAX_DEPTH = 30
_MAX_ITEMS = 1000  # items looked at per container when scanning for generators

# Pickled as handles when a process is spawned; outside a spawn they refuse to pickle.
_MP_SHARED = (
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
_LOCK_TYPES = (type(threading.Lock()), type(threading.RLock()))

_FIX_FUNCTION = ("define it as a named function at module level, or use an instance of a "
                 "module-level class with __call__ (bind arguments with functools.partial "
                 "or the class's attributes)")
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


@dataclass
class Report:
    """Preflight result for one DataLoader. `start_method` is None when it has no workers."""

    start_method: Optional[str]
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def raise_errors(self) -> None:
        """Raise `SaferunError` listing the errors, if any."""
        if self.errors:
            raise SaferunError("DataLoader preflight failed:\n" +
                               "\n".join(f"  - {e}" for e in self.errors))


def find_unpicklable(obj: Any, name: str = "dataset") -> list[Finding]:
    """Name every object inside `obj` that spawn or forkserver workers could not receive.

    Pickles `obj` the way a spawned worker receives it, into nothing, skipping
    tensors and arrays (they always pickle, and copying them would be slow);
    so it costs about one `pickle.dumps` of the Python objects in `obj`. If
    that fails, walks attributes, `__slots__`, list, tuple and dict items and
    `functools.partial` arguments to the innermost objects that fail.
    Returns [] when `obj` pickles.
    """
    error = _pickle_error(obj)
    if error is None:
        return []
    findings: list[Finding] = []
    _locate(obj, name, error, findings, set(), 0)
    return findings


def find_rng_objects(obj: Any, name: str = "dataset") -> list[Finding]:
    """Name the random generator objects stored inside `obj`, which workers do not reseed.

    Looks for `numpy.random.Generator`, `numpy.random.RandomState`,
    `torch.Generator` and `random.Random` instances (the global ones, which
    workers do reseed, are not reported). Containers are sampled: the first
    1000 items of each list, tuple or dict.
    """
    found: list[tuple[Finding, Any]] = []
    _scan_rng(obj, name, found, set(), 0)
    return [f for f, _ in found]


def rng_objects(obj: Any, name: str, skip: tuple[Any, ...] = ()) -> list[tuple[str, Any]]:
    """(attribute path, generator) for each generator object `find_rng_objects` would name,
    not looking inside the objects in `skip` (e.g. the dataset a sampler refers to)."""
    found: list[tuple[Finding, Any]] = []
    _scan_rng(obj, name, found, {id(o) for o in skip}, 0)
    return [(f.path, rng) for f, rng in found]


def start_method(loader: DataLoader) -> str:
    """The start method `loader`'s workers will use, without fixing the global default."""
    ctx = loader.multiprocessing_context
    if ctx is not None:
        return ctx.get_start_method()
    # get_start_method() without allow_none would freeze the default context.
    # The first of get_all_start_methods() is the platform default.
    chosen = multiprocessing.get_start_method(allow_none=True)
    return chosen or multiprocessing.get_all_start_methods()[0]


def check_loader(loader: DataLoader) -> Report:
    """Check what `loader` sends to its workers: errors for what fails now, warnings for later.

    Errors: objects that cannot be pickled when the start method pickles
    (spawn, forkserver), and torch.Generator objects, which crash spawned
    workers. Warnings: the same objects under fork (where they would fail
    under spawn or forkserver), and generator objects that every worker
    copies unchanged. A loader without workers gets an empty report.
    """
    if loader.num_workers == 0:
        return Report(start_method=None)
    method = start_method(loader)
    report = Report(start_method=method)
    pickles = method != "fork"
    for attr in SENT_TO_WORKERS:
        obj = getattr(loader, attr)
        for f in find_unpicklable(obj, attr):
            if pickles:
                report.errors.append(f"{f.path}: {f.what}; workers started with '{method}' "
                                     f"receive the {attr} pickled, so they cannot start. "
                                     f"Fix: {f.fix}.")
            else:
                report.warnings.append(f"{f.path}: {f.what}. Workers start now because they "
                                       f"fork, but under 'spawn' (macOS, Windows) or "
                                       f"'forkserver' (Linux from Python 3.14) they would not "
                                       f"start. Fix: {f.fix}.")
        found: list[tuple[Finding, Any]] = []
        _scan_rng(obj, attr, found, set(), 0)
        for f, rng in found:
            message = f"{f.path}: {f.what}; {_repeats(loader)}"
            if isinstance(rng, torch.Generator) and pickles:
                report.errors.append(f"{message}. Worse, workers started with '{method}' crash "
                                     f"while unpickling it ('unable to resize file', then "
                                     f"'DataLoader worker exited unexpectedly'). Fix: {f.fix}.")
            elif isinstance(rng, torch.Generator):
                report.warnings.append(f"{message}; under 'spawn' or 'forkserver' workers would "
                                       f"crash while unpickling it. Fix: {f.fix}.")
            else:
                report.warnings.append(f"{message}. Fix: {f.fix}.")
    return report


def check_batch_on_cpu(batch: Any, path: str = "batch") -> None:
    """Raise `SaferunError` naming the first tensor in a worker's batch that is not on the CPU.

    Workers should return CPU tensors: CUDA cannot be re-initialised in a
    forked worker, and CUDA tensors sent between processes are fragile.
    """
    for where, t in _tensors(batch, path):
        if t.device.type != "cpu":
            raise SaferunError(
                f"{where} is a tensor on {t.device}, delivered by a DataLoader worker. CUDA in "
                f"workers fails under fork ('Cannot re-initialize CUDA in forked subprocess') "
                f"and is fragile under spawn. Return CPU tensors from __getitem__ and "
                f"collate_fn; saferun moves each batch to the device (trainer.pin_memory "
                f"makes that copy asynchronous).")


# ---------------------------------------------------------------------- pickling


class _NullFile:
    def write(self, data: bytes) -> int:
        return len(data)


class _Probe(ForkingPickler):
    """ForkingPickler that skips what always pickles: tensors, arrays, shared mp objects.

    Tensors and storages would otherwise be moved into shared memory, and
    multiprocessing's locks and queues pickle only while a process is spawned.
    """

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        for cls, reducer in list(self.dispatch_table.items()):
            if getattr(reducer, "__module__", "") == "torch.multiprocessing.reductions":
                self.dispatch_table[cls] = _skip
        self.dispatch_table.update(_SKIPPED)


class _MainProbe(_Probe):
    """`_Probe` that also refuses classes and functions of an interactive __main__."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType)) and obj.__module__ == "__main__":
            raise pickle.PicklingError(f"{obj.__qualname__} is defined in an interactive "
                                       f"__main__, which spawned workers cannot import")
        return None


def _skip(obj: Any) -> tuple[Any, tuple[()]]:
    if isinstance(obj, torch.Tensor) and obj.requires_grad and not obj.is_leaf:
        raise pickle.PicklingError("a non-leaf tensor that requires grad cannot be sent to "
                                   "another process")
    return int, ()


def _skip_array(a: np.ndarray) -> Any:
    return (int, ()) if a.dtype != object else a.__reduce__()


_SKIPPED = {np.ndarray: _skip_array, **{cls: _skip for cls in _MP_SHARED}}


def _pickle_error(obj: Any) -> Optional[str]:
    # Only a notebook-like __main__ needs the slower per-object check.
    probe = _MainProbe if _interactive_main() else _Probe
    try:
        probe(_NullFile()).dump(obj)
    except Exception as e:  # pickling raises TypeError, AttributeError, PicklingError, ...
        return f"{type(e).__name__}: {e}"
    return None


def _interactive_main() -> bool:
    return getattr(sys.modules.get("__main__"), "__file__", None) is None


def _locate(obj: Any, path: str, error: str, findings: list[Finding], seen: set[int],
            depth: int) -> None:
    """Recurse into the children of `obj` that fail; if none does, `obj` is the offender."""
    seen.add(id(obj))
    failing = []
    if depth < _MAX_DEPTH:
        for suffix, child in _children(obj):
            if id(child) not in seen:
                child_error = _pickle_error(child)
                if child_error is not None:
                    failing.append((path + suffix, child, child_error))
    if not failing:
        findings.append(_describe(obj, path, error))
    for child_path, child, child_error in failing:
        _locate(child, child_path, child_error, findings, seen, depth + 1)


def _describe(obj: Any, path: str, error: str) -> Finding:
    cls = type(obj)
    if isinstance(obj, types.FunctionType):
        code = obj.__code__
        where = f"defined at {os.path.basename(code.co_filename)}:{code.co_firstlineno}"
        if obj.__name__ == "<lambda>":
            return Finding(path, f"a lambda ({where}), which cannot be pickled", _FIX_FUNCTION)
        if "<locals>" in obj.__qualname__:
            return Finding(path, f"a local function '{obj.__qualname__}' ({where}), which "
                                 f"cannot be pickled", _FIX_FUNCTION)
    if _interactive_main():
        if isinstance(obj, (type, types.FunctionType)) and obj.__module__ == "__main__":
            return Finding(path, f"'{obj.__qualname__}', defined in an interactive session "
                                 f"(__main__ has no file), which spawned workers cannot import",
                           "move it into a .py module and import it from there")
        if cls.__module__ == "__main__":
            return Finding(path, f"an instance of class '{cls.__qualname__}', defined in an "
                                 f"interactive session (__main__ has no file), which spawned "
                                 f"workers cannot import",
                           "move the class into a .py module and import it from there")
    if "<locals>" in cls.__qualname__:
        return Finding(path, f"an instance of the local class '{cls.__qualname__}', which "
                             f"cannot be pickled", "define the class at module level")
    if isinstance(obj, torch.Tensor) and obj.requires_grad and not obj.is_leaf:
        return Finding(path, "a tensor that is part of an autograd graph (requires_grad, not a "
                             "leaf), which cannot be sent to another process",
                       "store tensor.detach()")
    for kinds, what, fix in _KNOWN:
        if isinstance(obj, kinds):
            name = f" '{obj.__name__}'" if isinstance(obj, types.ModuleType) else ""
            return Finding(path, f"{what}{name}, which cannot be pickled", fix)
    return Finding(path, f"a {cls.__module__}.{cls.__qualname__}, which cannot be pickled "
                         f"({error})", _FIX_IN_WORKER)


_FIX_IN_WORKER = ("create it in the worker (lazily in __getitem__, or in worker_init_fn), or "
                  "drop it in __getstate__ and recreate it in __setstate__")
_KNOWN = (
    (types.GeneratorType, "a generator object",
     "store what it iterates over and create the generator where it is used"),
    (io.IOBase, "an open file",
     "store the path and open the file in the worker (lazily in __getitem__, or in "
     "worker_init_fn)"),
    (_LOCK_TYPES, "a threading lock", _FIX_IN_WORKER),
    (types.ModuleType, "the module", "import the module where it is used instead of storing it"),
)


# ---------------------------------------------------------------------- generators


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


def _scan_rng(obj: Any, path: str, found: list[tuple[Finding, Any]], seen: set[int],
              depth: int) -> None:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    kind = rng_kind(obj)
    if kind is not None:
        found.append((Finding(path, f"{kind}, which DataLoader workers do not reseed", _FIX_RNG),
                      obj))
        return
    if depth < _MAX_DEPTH:
        for i, (suffix, child) in enumerate(_children(obj)):
            if i == _MAX_ITEMS:
                break
            _scan_rng(child, path + suffix, found, seen, depth + 1)


def _repeats(loader: DataLoader) -> str:
    if loader.persistent_workers:
        return "every worker copies it in the same state, so all workers repeat the same draws"
    return ("every worker copies it in the same state at the start of every epoch, so all "
            "workers and all epochs repeat the same draws")


# ---------------------------------------------------------------------- object graph


def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    """(path suffix, child) for what pickling an object would include."""
    if isinstance(obj, np.ndarray) and obj.dtype == object:
        for i, v in enumerate(obj.flat):
            yield f".flat[{i}]", v
        return
    if isinstance(obj, _LEAVES) or isinstance(obj, _MP_SHARED):
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


def _tensors(obj: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor in a nested batch."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{path}[{k!r}]")
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):
        for f, v in zip(obj._fields, obj):
            yield from _tensors(v, f"{path}.{f}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{path}[{i}]")
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name), f"{path}.{f.name}")
