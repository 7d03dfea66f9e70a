"""Host-sync audit: which source lines read tensor values each training step, and what it costs.

The loop runs some steps under `saferun.guards.syncs.HostSyncCounter`, keeps each
step's `sites` (a Counter of "file:line"), and passes the list here. Each
site is attributed to the user's code, to a library, or to saferun itself
(which reads the device only at log steps), and reported with its syncs per
step and the line of source.
"""

from __future__ import annotations

import linecache
import os
import sysconfig
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..callbacks import Callback
from .syncs import CALLED_FROM

_SAFERUN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the package
_LIBRARY_DIRS = tuple({sysconfig.get_paths()[k] + os.sep for k in ("purelib", "platlib", "stdlib")})

COST = {
    "cuda": ("On CUDA each host sync makes Python wait until the GPU has finished all the work "
             "queued so far; the GPU then idles while Python prepares the next step."),
    "cpu": ("On the CPU a read costs little, but on CUDA each one would make Python wait until the "
            "GPU has finished all queued work, leaving the GPU idle while Python catches up."),
}
_ADVICE = {
    "user": ("keep the value on the device (loss.detach(), running sums) and read it at log steps; "
             "a Python if on a tensor also syncs (use torch.where)"),
    "library": ("a library reads a tensor value here on each call from your line after '<-': "
                "change what that call passes (an argument the library inspects, such as an "
                "all-ones mask it checks before skipping it, can often be left out) or make "
                "the call only at log steps"),
    "saferun": "saferun's own reads (at log steps and validation)",
    "unknown": "no Python source line was found for this read",
}


@dataclass(frozen=True)
class SyncSite:
    """One source line that read tensor values into Python during the audited steps."""

    site: str
    """'file:line'."""
    origin: str
    """'user', 'library', 'saferun' or 'unknown'."""
    total: int
    """Syncs at this line over all audited steps."""
    steps_with: int
    """Steps in which this line synced at least once."""
    per_step: float
    """total / number of audited steps."""
    code: str
    """The source line, stripped ('' when unavailable)."""
    caller: str = ""
    """For a library's line: 'file:line' of the user's code that called into the library."""
    caller_code: str = ""
    """The caller's source line, stripped."""


def audit(steps: Sequence[Mapping[str, int]]) -> list[SyncSite]:
    """Aggregate per-step `HostSyncCounter.sites` into one entry per line, most syncs first."""
    totals: dict[str, int] = {}
    steps_with: dict[str, int] = {}
    for sites in steps:
        for site, n in sites.items():
            if n:
                totals[site] = totals.get(site, 0) + n
                steps_with[site] = steps_with.get(site, 0) + 1
    num_steps = max(len(steps), 1)
    found = []
    for key, n in totals.items():
        site, _, caller = key.partition(CALLED_FROM)
        found.append(SyncSite(site, _origin(site), n, steps_with[key], n / num_steps,
                              _source(site), caller, _source(caller) if caller else ""))
    return sorted(found, key=lambda s: (-s.total, s.site))


def format_audit(steps: Sequence[Mapping[str, int]], device_type: str = "cuda") -> str:
    """A readable report of `audit(steps)`: one line per site, then what the syncs cost."""
    sites = audit(steps)
    per_step = sum(s.total for s in sites) / max(len(steps), 1)
    lines = [f"Host syncs: {per_step:.2f} per training step over {len(steps)} steps."]
    if not sites:
        return lines[0] + " None: the step never waits for the device."
    for s in sites:
        lines.append(f"  {s.per_step:5.2f}/step  {s.site}  [{s.origin}]" +
                     (f"  {s.code}" if s.code else ""))
        if s.caller:
            lines.append(f"             <- {s.caller}  [user]" +
                         (f"  {s.caller_code}" if s.caller_code else ""))
    for origin in ("user", "library", "unknown"):
        if any(s.origin == origin for s in sites):
            lines.append(f"  {origin} lines: {_ADVICE[origin]}.")
    lines.append("  " + COST.get(device_type, COST["cuda"]))
    return "\n".join(lines)


def _origin(site: str) -> str:
    path = site.rsplit(":", 1)[0]
    if not os.path.isabs(path):
        return "unknown"
    if path.startswith(_SAFERUN_DIR):
        return "saferun"
    if path.startswith(_LIBRARY_DIRS):
        return "library"
    return "user"


def _source(site: str) -> str:
    path, _, line = site.rpartition(":")
    if not line.isdigit():
        return ""
    return linecache.getline(path, int(line)).strip()


class SyncAudit(Callback):
    """guards.sync_audit: a diagnostic counting the host syncs of sampled training steps.

    An audited step runs under `HostSyncCounter` (every torch call intercepted: about 4x the
    time of a small model's step) and, on CUDA, with `torch.cuda.set_sync_debug_mode("warn")`,
    so each sync also prints torch's own warning with its stack. To keep its cost bounded it
    audits the first `first` steps of the run and then one step in every `every` (by step
    number); the other steps run untouched. A step is audited from the end of the step before
    (its log point, validation and save included) to its own end. The report goes to the
    `saferun` logger at the first log point and when training ends.
    """

    def __init__(self, device_type: str = "cpu", first: int = 20, every: int = 1000) -> None:
        from .syncs import HostSyncCounter

        self.device_type = device_type
        self.first, self.every = first, every
        self.counter = HostSyncCounter()
        self.steps: list[dict[str, int]] = []
        self._seen = 0  # steps of this run so far
        self._active = False
        self._reported_once = False

    def on_fit_start(self, view: Any) -> None:
        self._audit(view.step + 1)

    def on_train_step_end(self, view: Any, output: Any) -> None:
        self._seen += 1
        if self._active:
            self.steps.append(dict(self.counter.sites))
            self.counter.reset()
        self._audit(view.step + 1)

    def on_log(self, view: Any, metrics: Any) -> None:
        if not self._reported_once:
            self._reported_once = True
            self._report()

    def on_fit_end(self, view: Any, metrics: Any) -> None:
        self._stop()
        self._report()

    def on_exception(self, view: Any, exc: BaseException) -> None:
        self._stop()
        self._report()

    def _audit(self, step: int) -> None:
        """Count the syncs of `step` (the next one) if it is sampled; stop counting if not."""
        if self._seen < self.first or step % self.every == 0:
            self._start()
        else:
            self._stop()

    def _start(self) -> None:
        import torch

        if self._active:
            return
        self._active = True
        if self.device_type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        self.counter.__enter__()
        self.counter.reset()

    def _stop(self) -> None:
        import torch

        if not self._active:
            return
        self._active = False
        self.counter.__exit__(None, None, None)
        if self.device_type == "cuda":
            torch.cuda.set_sync_debug_mode("default")

    def _report(self) -> None:
        import logging

        sampled = (f"the first {self.first} steps of the run, then one in every {self.every}; "
                   f"{len(self.steps)} of {self._seen} steps audited")
        logging.getLogger("saferun").warning("Sync audit (guards.sync_audit; %s):\n%s", sampled,
                                             format_audit(self.steps, self.device_type))
