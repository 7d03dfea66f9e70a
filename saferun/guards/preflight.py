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

import logging
import multiprocessing
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.utils.data import DataLoader

from ..errors import SaferunError
from .batchinfo import tensors
from ..data.generators import Finding, find_rng_objects, rng_kind, rng_objects, scan_rng
from .pickling import find_unpicklable

__all__ = ["SENT_TO_WORKERS", "Finding", "Report", "check_batch_on_cpu", "check_loader",
           "find_rng_objects", "find_unpicklable", "preflight", "rng_kind", "rng_objects",
           "start_method"]

log = logging.getLogger("saferun")

# What DataLoader passes to each worker process (torch/utils/data/dataloader.py).
SENT_TO_WORKERS = ("dataset", "collate_fn", "worker_init_fn")


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


def preflight(*loaders: Optional[DataLoader]) -> None:
    """guards.preflight: check each loader; log the warnings (each once: the training and
    validation loaders often share a dataset class and find the same), raise the errors."""
    said: set[str] = set()
    for loader in loaders:
        if loader is not None:
            report = check_loader(loader)
            for warning in report.warnings:
                if warning not in said:
                    log.warning("DataLoader preflight: %s", warning)
                said.add(warning)
            report.raise_errors()


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
        scan_rng(obj, attr, found, set(), 0)
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
    for where, t in tensors(batch, path):
        if t.device.type != "cpu":
            raise SaferunError(
                f"{where} is a tensor on {t.device}, delivered by a DataLoader worker. CUDA in "
                f"workers fails under fork ('Cannot re-initialize CUDA in forked subprocess') "
                f"and is fragile under spawn. Return CPU tensors from __getitem__ and "
                f"collate_fn; saferun moves each batch to the device (trainer.pin_memory "
                f"makes that copy asynchronous).")


def _repeats(loader: DataLoader) -> str:
    if loader.persistent_workers:
        return "every worker copies it in the same state, so all workers repeat the same draws"
    return ("every worker copies it in the same state at the start of every epoch, so all "
            "workers and all epochs repeat the same draws")
