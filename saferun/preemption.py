"""Preemption: SIGTERM/SIGINT (and the signals added in `trainer.stop_signals`, such as the
SIGUSR1 or SIGUSR2 a cluster scheduler sends before the time limit) set a flag; the loop saves
at the next step boundary and exits.

The documented behaviour, in full:

- The first stop signal sets a flag and prints one notice. The step in progress
  finishes (a validation in progress is interrupted and recorded as owed), a checkpoint
  of that step boundary is saved, and the process exits with status 128 + the signal
  number (143 for SIGTERM, 130 for SIGINT): `Preempted`.
- A SIGINT after that (the second Ctrl-C), before the checkpoint is complete, aborts at
  once: the process kills itself with SIGINT (status -2, which a shell shows as 130),
  without saving. A save in progress is abandoned in its temporary directory, so every
  earlier checkpoint stays intact and `resume=auto` continues from the newest one.
  Once the checkpoint is complete, a SIGINT ends the process at once with the status
  that says it was saved (128 + the first signal).
- Repeated SIGTERMs (or other stop signals but SIGINT) change nothing: launchers deliver the same SIGTERM more than once
  (to the process group and again to each process).
- DataLoader workers are started with SIGTERM, SIGINT, SIGUSR1 and SIGUSR2 blocked (`shielded_iter`), so a signal
  sent to the whole process group (a scheduler, a terminal's Ctrl-C) reaches only the
  main process, which decides when to stop; the workers are shut down normally (and any
  still alive at exit are killed, since multiprocessing would end them with SIGTERM).

The handler sets the flag and writes one line with `os.write` (unbuffered, so it cannot
collide with a half-written `print`); it runs no collective and touches no checkpoint.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import signal
import sys
import threading
from multiprocessing import resource_tracker
from types import FrameType
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Blocked in DataLoader workers: a scheduler may send any of them to the whole process group.
SHIELDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


class Preempted(SystemExit):
    """Training stopped on a signal after saving a checkpoint; exit status 128 + signal number."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(128 + signum)
        self.signum = signum
        self.message = message

    def __str__(self) -> str:
        return self.message


class StopSignals:
    """Context manager: while active, the stop signals (SIGTERM, SIGINT and `extra`, by name
    such as "SIGUSR2") set `received` instead of killing.

    Call `saved()` once the stop's checkpoint is complete (see the module docstring).
    """

    def __init__(self, extra: Iterable[str] = ()) -> None:
        self.signals = tuple(dict.fromkeys([*SIGNALS, *(signal.Signals[name] for name in extra)]))
        self.received: Optional[int] = None
        self._saved = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def while_stopping(self) -> contextlib.AbstractContextManager[Any]:
        """Active again (for the stop's save and exit) if a stop is under way; else nothing."""
        return self if self.received is not None else contextlib.nullcontext()

    def saved(self) -> None:
        """The checkpoint of the stop is complete: a second Ctrl-C now just exits."""
        self._saved = True

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.received is None:
            self.received = signum
            _say(f"saferun: {signal_name(signum)} received: finishing the current step to save "
                 f"a checkpoint, then exiting (Ctrl-C again aborts without saving).")
        elif signum == signal.SIGINT:
            self._abort()

    def _abort(self) -> None:
        """The second Ctrl-C. No exception: one raised here could be swallowed (by a
        `__del__`, such as a DataLoader iterator's shutdown) or caught by user code."""
        assert self.received is not None
        if self._saved:
            _say("saferun: second SIGINT: the checkpoint is saved; exiting now.")
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(128 + self.received)
        _say("saferun: second SIGINT: aborting now, without saving. Earlier checkpoints are "
             "intact; resume=auto continues from the newest one.")
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)


@contextlib.contextmanager
def workers_shielded() -> Iterator[None]:
    """Block the SHIELDED signals in this thread while child processes start.

    Children inherit the blocked set (through fork, and through exec with spawn and
    forkserver), so DataLoader workers never act on a signal sent to the process group.
    A signal arriving meanwhile is held and delivered when the block ends.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, SHIELDED)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


_shielded: set[int] = set()  # pids of the worker processes started shielded


def shielded_iter(loader: Iterable[Any]) -> Iterator[Any]:
    """`iter(loader)`, with any worker processes it starts shielded from stop signals."""
    context = getattr(loader, "multiprocessing_context", None) or multiprocessing.get_context()
    if getattr(loader, "num_workers", 0) and context.get_start_method() != "fork":
        # spawn and forkserver need multiprocessing's resource tracker; starting it unblocks
        # SIGINT and SIGTERM in this thread, so it must be running before the block.
        resource_tracker.ensure_running()
    before = {p.pid for p in multiprocessing.active_children()}
    with workers_shielded():
        batches = iter(loader)
    started = {p.pid for p in multiprocessing.active_children()} - before
    if started and not _shielded:
        # Registered after multiprocessing's own exit handler, so it runs before it.
        atexit.register(_end_shielded_workers)
    _shielded.update(pid for pid in started if pid is not None)
    return batches


def _end_shielded_workers() -> None:
    """At exit, multiprocessing ends the daemonic children still alive (a DataLoader's
    persistent workers, an iterator kept alive by a traceback) with SIGTERM and waits for
    them: shielded workers would not act on it, so they are killed here first."""
    alive = [p for p in multiprocessing.active_children() if p.pid in _shielded and p.daemon]
    if alive and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's handler would call it a failure
    for process in alive:
        process.kill()


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def _say(line: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, (line + "\n").encode())


class StopRequested(Exception):
    """Raised inside the loop when a stop signal arrived; fit() turns it into `Preempted`."""


def stop_exit(exc: BaseException, signals: StopSignals, one_process: bool, mid_step: bool,
              save: Callable[[], Path], newest: Callable[[], Optional[tuple[Path, int]]],
              step: int, run_dir: str, owed: bool) -> Optional[BaseException]:
    """After SIGTERM/SIGINT: save this step boundary (`save`) and build the exit, else None
    (`newest`: the run's newest checkpoint and its step, or None, `Checkpointer.newest`).

    Only a true boundary is saved: the loop's stop (`StopRequested`, raised between
    steps or between validation batches) or, in one process, a DataLoader worker's
    death while the loop was fetching the next step's batches. Workers are shielded
    from signals to the process group; if one dies anyway in the middle of a step,
    nothing is saved (half a step cannot be resumed exactly) and the error says so.
    """
    from .errors import SaferunError

    signum = signals.received
    worker_died = (isinstance(exc, RuntimeError) and "DataLoader worker" in str(exc)
                   and one_process)  # under torchrun the ranks must agree
    if signum is None or not (isinstance(exc, StopRequested) or worker_died):
        return None
    if worker_died and mid_step:
        found = newest()
        return SaferunError(
            f"stopped by {signal_name(signum)}, but a DataLoader worker died in the middle "
            f"of a step (after step {step}): {exc} No checkpoint was saved: a "
            f"half-done step cannot be resumed exactly. The newest checkpoint is "
            f"{found[0] if found else 'none'}; resume=auto continues from it.")
    path = save()
    signals.saved()
    note = " (its validation was interrupted: the resumed run validates first)" if owed else ""
    message = (f"saferun: stopped by {signal_name(signum)} at step {step}{note}; "
               f"checkpoint {path}. To continue, run again with the same run directory "
               f"and resume=auto (command line: add hydra.run.dir={run_dir} "
               f"resume=auto), or with resume={path}.")
    print(message, file=sys.stderr, flush=True)
    return Preempted(signum, message)
