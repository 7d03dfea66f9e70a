"""The intent of a change of course, durable before anything else happens: `saferun run` with
`resume=PATH` (and a `Trainer` built with it and a run directory) writes
`<run dir>/.course-intent.json` naming PATH the moment it knows it, before torch is imported
and the model built. A run killed in that start-up (before `course.py` records the change
itself) leaves the intent, and a later `resume=auto` carries it out instead of continuing
the course that is there without a word. The change's own record (`.course-change.json`)
supersedes it; both go once the continued course has its first checkpoint.

Imports nothing heavy (the command line writes the intent before torch is imported)."""

from __future__ import annotations

import json
import os
import secrets
import signal
from pathlib import Path
from typing import Optional

from ..errors import SaferunError

INTENT = ".course-intent.json"
_WORDS = {"auto", "fresh"}


def intend(run_dir: str, resume: Optional[str], main: bool) -> bool:
    """resume=PATH (a directory: a checkpoint or a run directory): record the intent in
    `run_dir`, atomically (rank 0), and return True. Anything else records nothing."""
    if resume is None or resume in _WORDS or not os.path.isdir(resume):
        return False
    if not main:
        return True
    folder = Path(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".tmp-intent-{secrets.token_hex(4)}"
    with open(tmp, "w") as f:
        json.dump({"resume": os.path.abspath(resume)}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / INTENT)
    fsync_dir(folder)
    kill_point("course-startup")
    return True


def intended(run_dir: str) -> Optional[str]:
    """The PATH of an intent a killed run left in `run_dir`, or None."""
    path = Path(run_dir) / INTENT
    if not path.is_file():
        return None
    try:
        resume = json.loads(path.read_text())["resume"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SaferunError(f"{path} (the intent of a change of course a killed run left) is "
                           f"unreadable ({e!r}): run with resume=PATH to make that change, or "
                           f"delete the file to continue the course that is there.") from None
    return str(resume)


def drop_intent(run_dir: str, main: bool) -> None:
    """The intent is carried out (recorded, or nothing to supersede), or refused."""
    path = Path(run_dir) / INTENT
    if main and path.is_file():
        path.unlink()
        fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make a rename or unlink in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def kill_point(name: str) -> None:
    """Fault injection (tools/fault_inject.py, tests): SAFERUN_KILL_AT=<name> kills this
    process here with SIGKILL, as a node failure would."""
    if os.environ.get("SAFERUN_KILL_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)
