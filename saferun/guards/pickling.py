"""Can spawn or forkserver workers receive it? `find_unpicklable` pickles an object the way a
spawned worker receives it (into nothing, skipping tensors and arrays) and, if that fails,
names the innermost objects that fail, with a fix for each."""

from __future__ import annotations

import io
import os
import pickle
import sys
import threading
import types
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.multiprocessing  # registers the tensor reducers that _Probe replaces

from ..data.generators import MAX_DEPTH, MP_SHARED, Finding, children

_LOCK_TYPES = (type(threading.Lock()), type(threading.RLock()))

_FIX_FUNCTION = ("define it as a named function at module level, or use an instance of a "
                 "module-level class with __call__ (bind arguments with functools.partial "
                 "or the class's attributes)")


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


_SKIPPED: dict[type, Callable[[Any], Any]] = {np.ndarray: _skip_array, **{cls: _skip for cls in MP_SHARED}}


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
    if depth < MAX_DEPTH:
        for suffix, child in children(obj):
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
