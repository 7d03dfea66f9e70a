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
by construction and are not counted: they never wait for the device.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
from types import FrameType
from typing import Any, Callable, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_HOST_SIDE = tuple(os.path.join(_TORCH_DIR, d) + os.sep for d in ("optim", os.path.join("utils", "data")))
_THIS_FILE = __file__

_READS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__,
    torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.__complex__, torch.Tensor.numpy,
}
_aten = torch.ops.aten


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
    """file:line of the innermost frame outside torch, or None for host-side torch code."""
    frame: Optional[FrameType] = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename in _PASS_THROUGH:
            pass
        elif filename.startswith(_HOST_SIDE):
            return None
        elif not filename.startswith(_TORCH_DIR):
            return f"{filename}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


class _FunctionReads(TorchFunctionMode):
    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func: Callable, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func not in _READS:
            return func(*args, **kwargs)
        self.counter._record()
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
