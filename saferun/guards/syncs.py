"""Counting host syncs: every read of a tensor's value into Python.

`.item()`, `float(t)`, `int(t)`, `bool(t)`, `if t:` and `.tolist()` copy a value
to the host; on CUDA each one waits for all queued GPU work (a stream sync).
`HostSyncCounter` counts them with two interposers, because neither sees all:

- a `TorchFunctionMode` sees the Python-level reads (`Tensor.item`, `tolist`,
  `__bool__`, ...), including reads of inference tensors, which a dispatch mode
  does not see;
- a `TorchDispatchMode` sees `aten._local_scalar_dense` issued from C++ and, on
  CUDA, blocking device-to-host copies (`.cpu()`, `.to("cpu")`).

Reads made inside `torch/optim` (Adam's host-side `step` counters) and
`torch/utils/data` (sampler seeds drawn from CPU generators) touch host tensors
by construction and are not counted: they never wait for the device. Nor are, on a
CPU run, reads that would not be syncs on a GPU: of a tensor that lives on the host in
any run (made by a factory such as `torch.rand([])` without a device, and what is
computed from such tensors alone; one that an in-place op, `out=` or an assignment fills
with device data is no longer host-only), and the value checks torch makes only on CPU
tensors (`F.one_hot`'s range check, skipped on CUDA when `num_classes` is given).

A read inside a library (site-packages, the standard library) is reported at the
library's line and at the line of the user's code that called into it
("lib.py:354 <- train.py:42"): the user changes the call, not the library.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import sys
import sysconfig
import weakref
from types import FrameType
from typing import Any, Callable, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_HOST_SIDE = tuple(os.path.join(_TORCH_DIR, d) + os.sep for d in ("optim", os.path.join("utils", "data")))
_THIS_FILE = __file__
_SAFERUN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the package
LIBRARY_DIRS = tuple({sysconfig.get_paths()[k] + os.sep for k in ("purelib", "platlib", "stdlib")})
CALLED_FROM = " <- "  # site of a library read, then the user's line that led there

_READS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__,
    torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.__complex__, torch.Tensor.numpy,
}
_aten = torch.ops.aten
# Factories that make a tensor on the default device when given no device (and no tensor).
_FACTORIES = {
    torch.rand, torch.randn, torch.randint, torch.randperm, torch.zeros, torch.ones, torch.empty,
    torch.full, torch.arange, torch.linspace, torch.tensor, torch.as_tensor, torch.scalar_tensor,
}
_MOVES = {torch.Tensor.to, torch.Tensor.cuda}  # a batch moved to the device is no longer host-only
# torch checks the values of these on CPU tensors only (a read there, none on CUDA), when the
# keyword named is given: F.one_hot reads min and max unless on CUDA with num_classes >= 0.
_CPU_ONLY_CHECKS = {torch.nn.functional.one_hot: "num_classes"}


class HostSyncCounter:
    """Context manager counting host syncs, with the source line of each.

    Attributes:
        count: syncs counted while active.
        sites: `Counter` of "file:line" of the innermost frame outside torch.
    """

    def __init__(self) -> None:
        self.count = 0
        self.sites: collections.Counter[str] = collections.Counter()
        self.once = 0  # reads of saferun's first-step audits (see `one_time_reads`), apart
        self._in_read = False
        self._host: dict[int, weakref.ref[torch.Tensor]] = {}  # tensors on the host in any run
        self._fmode = _FunctionReads(self)
        self._dmode = _DispatchReads(self)

    def __enter__(self) -> "HostSyncCounter":
        self._dmode.__enter__()
        self._fmode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._fmode.__exit__(*exc)
        self._dmode.__exit__(*exc)

    def reset(self) -> None:
        self.count = 0
        self.sites.clear()

    def _mark_host(self, out: Any) -> None:
        for t in _leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                key = id(t)  # freed with the tensor, lest a new tensor at its address inherit it
                self._host[key] = weakref.ref(t, functools.partial(self._forget, key))

    def _forget(self, key: int, ref: Any) -> None:
        if self._host.get(key) is ref:
            del self._host[key]

    def _forget_host(self, out: Any) -> None:
        """`out` now holds values from the run's device (and so does the tensor it views)."""
        for t in _leaves(out):
            if isinstance(t, torch.Tensor):
                self._host.pop(id(t), None)
                if t._base is not None:
                    self._host.pop(id(t._base), None)

    def _is_host(self, t: Any) -> bool:
        ref = self._host.get(id(t)) if isinstance(t, torch.Tensor) else None
        return ref is not None and ref() is t

    def _record(self) -> None:
        if _ONE_TIME[0]:
            self.once += 1
            return
        site = _user_site()
        if site is not None:
            self.count += 1
            self.sites[site] += 1


_ONE_TIME = [0]
_PASS_THROUGH = {_THIS_FILE}  # modes that call on: a read they pass on is the caller's


@contextlib.contextmanager
def one_time_reads() -> Iterator[None]:
    """Reads made inside are counted apart from the loop's (`HostSyncCounter.once`): saferun's
    first-step audits read a few values once per fit, never per step."""
    _ONE_TIME[0] += 1
    try:
        yield
    finally:
        _ONE_TIME[0] -= 1


def pass_through(filename: str) -> None:
    """Attribute reads that pass through `filename` (a TorchFunctionMode that calls on) to the
    frame that made them."""
    _PASS_THROUGH.add(filename)


def _user_site() -> Optional[str]:
    """file:line of the innermost frame outside torch (if that is a library's, followed by the
    user's line that called into it), or None for host-side torch code."""
    frame: Optional[FrameType] = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename in _PASS_THROUGH:
            pass
        elif filename.startswith(_HOST_SIDE):
            return None
        elif not filename.startswith(_TORCH_DIR):
            site = f"{filename}:{frame.f_lineno}"
            return site + _caller_outside_libraries(frame) if _in_library(filename) else site
        frame = frame.f_back
    return "<unknown>"


def _in_library(filename: str) -> bool:
    return filename.startswith(LIBRARY_DIRS) and not filename.startswith(_SAFERUN_DIR)


def _caller_outside_libraries(frame: Optional[FrameType]) -> str:
    """CALLED_FROM + the innermost frame of the user's code (not a library, torch or saferun)
    that led into library code; '' if there is none."""
    while frame is not None:
        filename = frame.f_code.co_filename
        if not (filename.startswith(_TORCH_DIR) or _in_library(filename)
                or filename.startswith(_SAFERUN_DIR) or filename.startswith("<")):
            return f"{CALLED_FROM}{filename}:{frame.f_lineno}"
        frame = frame.f_back
    return ""


def _leaves(tree: Any) -> list[Any]:
    if isinstance(tree, (tuple, list)):
        return [x for v in tree for x in _leaves(v)]
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in _leaves(v)]
    return [tree]


class _FunctionReads(TorchFunctionMode):
    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func: Callable, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        counter = self.counter
        if func not in _READS:
            inputs = [t for t in _leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            check = _CPU_ONLY_CHECKS.get(func)
            skip_check = check is not None and kwargs.get(check, args[1] if len(args) > 1 else -1) \
                not in (-1, None) and all(t.device.type == "cpu" for t in inputs)
            counter._in_read |= skip_check
            try:
                out = func(*args, **kwargs)
            finally:
                counter._in_read &= not skip_check
            if func in _MOVES and (func is torch.Tensor.cuda or kwargs.get("device") is not None
                                   or any(isinstance(a, (torch.device, str)) for a in args[1:])):
                counter._host.pop(id(out), None)  # moved to the run's device (a GPU's, there)
            elif inputs and all(counter._is_host(t) for t in inputs) or (
                    func in _FACTORIES and not inputs and kwargs.get("device") is None
                    and torch.get_default_device().type == "cpu"):
                counter._mark_host(out)
            else:  # written from device data: an in-place op, `out=`, an assignment into it
                counter._forget_host(out if func is not torch.Tensor.__setitem__ else args[0])
            return out
        if not counter._is_host(args[0] if args else None):
            counter._record()
        self.counter._in_read = True  # the dispatch mode must not count this read again
        try:
            return func(*args, **kwargs)
        finally:
            self.counter._in_read = False


class _DispatchReads(TorchDispatchMode):
    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not self.counter._in_read and _is_sync(func, args, kwargs):
            self.counter._record()
        return func(*args, **kwargs)


def _is_sync(func: Any, args: Any, kwargs: Any) -> bool:
    if func is _aten._local_scalar_dense.default:
        return True
    if func is _aten._to_copy.default:
        src, dst = args[0], kwargs.get("device")
        return (src.device.type == "cuda" and dst is not None and torch.device(dst).type == "cpu"
                and not kwargs.get("non_blocking", False))
    if func is _aten.copy_.default:
        dst, src = args[0], args[1]
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        return src.device.type == "cuda" and dst.device.type == "cpu" and not non_blocking
    return False
