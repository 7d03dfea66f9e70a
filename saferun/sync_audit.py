"""Host-sync audit: which source lines read tensor values each training step, and what it costs.

The loop runs some steps under `saferun.syncs.HostSyncCounter`, keeps each
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
from typing import Mapping, Sequence

_SAFERUN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
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
    "library": "a library call reads a tensor value here; call it only at log steps",
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
    found = [SyncSite(site, _origin(site), n, steps_with[site], n / num_steps, _source(site))
             for site, n in totals.items()]
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
