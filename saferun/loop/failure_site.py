"""Where a failure happened, recorded by the loop where it calls the user's code.

The loop's call sites (a training micro-batch, an `optimize()` call, a validation or predict
batch) add what they know to the exception as it passes through them, innermost first; the
explanation (diagnose/explain.py) reads it back. Nothing here runs unless something raised: a
`try` costs nothing on the path that does not raise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

_ATTRIBUTE = "_saferun_site"


@dataclass
class FailureSite:
    """What the loop knew where an exception passed: each field set by the innermost site
    that knows it."""

    phase: Optional[str] = None  # "training", "validation" or "predict"
    batch: Any = None  # the batch that step received (on the host or the device)
    micro_batch: Optional[tuple[int, int]] = None  # (index, count) under trainer.accumulate
    optimizer: Optional[str] = None  # the name given to the self.optimize(name, loss) that raised
    optimize_part: Optional[str] = None  # "backward" or "step" of that call, else ""


def record(exc: BaseException, **where: Any) -> None:
    """Add `where` (FailureSite fields) to `exc`'s site; fields an inner site set are kept."""
    site = getattr(exc, _ATTRIBUTE, None)
    if site is None:
        site = FailureSite()
        try:
            setattr(exc, _ATTRIBUTE, site)
        except (AttributeError, TypeError):  # an exception type without a __dict__
            return
    for name, value in where.items():
        if getattr(site, name) is None:
            setattr(site, name, value)


def site_of(exc: BaseException) -> Optional[FailureSite]:
    """The site recorded on `exc`, or None when no loop call site saw it."""
    site = getattr(exc, _ATTRIBUTE, None)
    return site if isinstance(site, FailureSite) else None
