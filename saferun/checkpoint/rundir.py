"""The run directory: checked before any work, one writer at a time, and its config.yaml.

`claim` (at the start of `fit`) creates the directory if needed, proves it writable and
takes an exclusive `fcntl.flock` on `<run dir>/.saferun.lock` until `fit` returns. A second
writer (another `saferun run` on the same directory, or a second Trainer in this process)
is refused: two writers delete each other's temporary files and leave checkpoints of two
different runs side by side. The kernel releases the lock when its process dies, however
it dies, so a crash never leaves a stale lock; DataLoader workers forked while it is held
close their copy, so orphaned workers of a killed run cannot keep it.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import secrets
import socket
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from ..errors import SaferunError

LOCK_FILE = ".saferun.lock"
_held: set[int] = set()  # descriptors of the locks this process holds


def _close_in_child() -> None:
    # A forked child shares the lock's open file; closing its copy leaves the parent's lock
    # as it was, and makes the lock go away with the parent alone.
    for fd in _held:
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


class RunDirLock:
    """The claim on a run directory; `release` ends it (a no-op on ranks other than 0)."""

    def __init__(self, fd: Optional[int] = None) -> None:
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            _held.discard(self._fd)
            os.close(self._fd)  # closing the only descriptor releases the flock
            self._fd = None


def claim(run_dir: str, main: bool = True) -> RunDirLock:
    """Check that `run_dir` is a writable directory and lock it; raise `SaferunError` if not.

    Under torchrun only rank 0 (`main`) writes, so only it locks; every rank gets its verdict.
    """
    from .. import distributed  # (here: the command line checks a run directory before torch)

    lock, error = RunDirLock(), None
    if main:
        try:
            lock = _lock(Path(run_dir))
        except SaferunError as e:
            error = str(e)
    error = distributed.broadcast(error)
    if error is not None:
        lock.release()
        raise SaferunError(error)
    return lock


def _lock(path: Path) -> RunDirLock:
    problem = check_writable(path)
    if problem is not None:
        raise SaferunError(problem)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise SaferunError(_not_writable(path, e)) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        if holder.startswith(f"pid {os.getpid()} "):
            holder += ": this process, another Trainer's fit()"
        raise SaferunError(
            f"the run directory {path} is in use by another run ({holder}). "
            f"Two runs writing one directory delete each other's checkpoints and leave "
            f"checkpoints of both side by side. Wait until it ends (resume=auto then continues "
            f"it), or give this run its own directory (hydra.run.dir=... or trainer.run_dir).") from None
    _held.add(fd)
    started = datetime.datetime.now().isoformat(timespec="seconds")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {started}\n".encode(), 0)
    lock = RunDirLock(fd)
    checkpoints = path / "checkpoints"
    if checkpoints.is_dir():  # a resume writes there; find out now, not after training
        probe = checkpoints / f".tmp-probe-{secrets.token_hex(4)}"
        try:
            probe.mkdir()
            probe.rmdir()
        except OSError as e:
            lock.release()
            raise SaferunError(_not_writable(checkpoints, e)) from None
    return lock


def default_run_dir() -> str:
    """The run directory of a Trainer given no trainer.run_dir: runs/<YYYYmmdd-HHMMSS>-<4 hex>,
    one that does not exist yet, so that two fit()s started within a second (a loop over
    learning rates, k folds) never meet in one directory; rank 0's on every rank."""
    from .. import distributed

    while True:
        path = os.path.join("runs", f"{datetime.datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(2)}")
        if not os.path.exists(path):
            return distributed.broadcast(path)


def check_writable(path: Path) -> Optional[str]:
    """Why `path` cannot be (or become) a writable run directory, or None if it can."""
    existing = next(p for p in (path, *path.absolute().parents) if p.exists())
    if existing == path and not path.is_dir():
        return (f"the run directory {path} exists and is not a directory. Choose another "
                f"(hydra.run.dir=... on the command line, trainer.run_dir in Python).")
    if not existing.is_dir():
        return (f"the run directory {path} cannot be created: {existing} is not a directory. "
                f"Choose another (hydra.run.dir=... on the command line, trainer.run_dir in "
                f"Python).")
    if not os.access(existing, os.W_OK | os.X_OK):
        return _not_writable(existing, None)
    return None


def _not_writable(path: Path, error: Optional[OSError]) -> str:
    why = f" ({error.strerror or error})" if error is not None else ""
    return (f"cannot write in {path}{why}: the run's checkpoints, config.yaml and TensorBoard "
            f"events go there. Choose a writable run directory (hydra.run.dir=... on the "
            f"command line, trainer.run_dir in Python) or fix its permissions.")


def write_config(run_dir: str, config: Mapping[str, Any]) -> None:
    """Write the run's resolved config to `<run_dir>/config.yaml` (atomically), and what
    `when_accepted` asked to write with it."""
    import yaml

    global _with_config
    path = Path(run_dir) / "config.yaml"
    tmp = path.with_name(f".tmp-config-{secrets.token_hex(4)}.yaml")
    try:
        tmp.write_text(yaml.safe_dump(dict(config), sort_keys=False))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if _with_config is not None and Path(_with_config[0]) == Path(run_dir):
        _with_config[1]()
    _with_config = None


_with_config: Optional[tuple[str, Callable[[], None]]] = None


def update_summary(run_dir: str, entries: Mapping[str, Any]) -> None:
    """Set `entries` in <run_dir>/summary.json (created if absent), atomically; other keys stay."""
    import json

    path = Path(run_dir) / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    summary = json.loads(path.read_text()) if path.is_file() else {}
    tmp = path.with_name(f".tmp-summary-{secrets.token_hex(4)}.json")
    try:
        tmp.write_text(json.dumps({**summary, **entries}, indent=2))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def writes_hydra_dir(run_dir: str) -> bool:
    """Whether this run writes `run_dir`'s .hydra/ once accepted (`when_accepted`): one there
    now is an earlier run's."""
    return _with_config is not None and Path(_with_config[0]) == Path(run_dir)


def when_accepted(run_dir: str, write: Callable[[], None]) -> None:
    """Call `write` when the run in `run_dir` is accepted, with its config.yaml: the command
    line writes Hydra's .hydra/ files so, and a refused run leaves them as they were."""
    global _with_config
    _with_config = (run_dir, write)
