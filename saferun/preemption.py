"""Preemption: SIGTERM/SIGINT only set a flag; the loop saves and exits at a boundary.

Nothing but an assignment runs inside the handler (no I/O, no collective), so a
signal can never interrupt a half-written checkpoint or deadlock a process group.
A second SIGINT aborts at once, as users expect from Ctrl-C.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any, Optional

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(SystemExit):
    """Training stopped on a signal after saving a checkpoint; exit status 128 + signal number."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(128 + signum)
        self.signum = signum
        self.message = message

    def __str__(self) -> str:
        return self.message


class StopSignals:
    """Context manager: while active, SIGTERM and SIGINT set `received` instead of killing."""

    def __init__(self) -> None:
        self.received: Optional[int] = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if signum == signal.SIGINT and self.received is not None:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now, without saving
        self.received = signum


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class StopRequested(Exception):
    """Raised inside the loop when a stop signal arrived; fit() turns it into `Preempted`."""
