"""The run directory of `saferun run`: what is refused about it before any work, and a
refused run's directory removed again (a refused run leaves nothing behind)."""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Optional, Sequence

from ..errors import SaferunError
from .compose import generated_part

# Hydra makes the command line's run directory (and writes saferun.log and .hydra/ there):
# one way to name it, not two that could disagree.
TRAINER_RUN_DIR = ("trainer.run_dir is the Python API's run directory; on the command line "
                   "Hydra makes the run directory (its saferun.log and .hydra/ go there), so it "
                   "would be ignored. Set hydra.run.dir=DIR instead (hydra.sweep.dir=DIR for a "
                   "sweep, -m).")
_LEFT_BY_A_REFUSED_RUN = {"saferun.log", ".saferun.lock", ".hydra"}
# A hydra.run.dir given that did not exist (made for this run), and its first existing parent.
_absent: Optional[tuple[Path, Path]] = None


def note_args(args: Sequence[str]) -> None:
    """Before Hydra starts: note whether a `hydra.run.dir=` given exists yet."""
    global _absent
    for arg in args:
        key, _, value = arg.partition("=")
        if key == "hydra.run.dir" and "${" not in value and not Path(value).exists():
            path = Path(value).absolute()
            _absent = path, next(p for p in path.parents if p.exists())


def check_run_dir(configured: Optional[str], resume: Optional[str], run_dir: str,
                  args: Sequence[str], multirun: bool) -> None:
    """Raise `SaferunError` for a trainer.run_dir set in a config file, or resume=auto in a
    run directory made up for this run (there is nothing in it to continue)."""
    if configured is not None:
        raise SaferunError(f"trainer.run_dir={configured} is set (on the command line or in a "
                           f"config file): {TRAINER_RUN_DIR}")
    made = generated_part(run_dir)
    if resume == "auto" and made is not None:
        raise SaferunError(_nothing_to_resume(made, args, multirun))


def _nothing_to_resume(made: Path, args: Sequence[str], multirun: bool) -> str:
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    message = (f"resume=auto, but {key} is not set, so this run's directory {_shown(made)} was "
               f"made for it just now: there is nothing in it to continue, and training would "
               f"start from step 0.")
    earlier = _latest_runs(made.parent, made)
    if not earlier:
        return (message + f" No earlier run under {_shown(made.parent)} left a checkpoint. To "
                f"start a new run, drop resume=auto; to continue a run kept elsewhere, add "
                f"{key}=<its directory>.")
    listed = "; ".join(f"{_shown(d)} (step {step})" for d, step in earlier)
    kept = [a for a in args if not a.startswith(f"{key}=")]
    command = shlex.join(["saferun", "run", *kept, *([] if "resume=auto" in kept else ["resume=auto"]),
                          f"{key}={_shown(earlier[0][0])}"])
    return (message + f" The latest runs under {_shown(made.parent)} with checkpoints: {listed}. "
            f"To continue the latest: {command}")


def _latest_runs(parent: Path, made: Path, n: int = 3) -> list[tuple[Path, int]]:
    """Up to `n` run directories beside `made` that hold checkpoints, the most recently saved
    first, each with its latest step (a sweep's: the latest of its jobs)."""
    from ..checkpoint.store import LOCAL, list_checkpoints, step_of  # (before any Trainer)

    found = []
    for d in (p for p in parent.iterdir() if p.is_dir() and p != made):
        saved = [c for root in (d / "checkpoints", *d.glob("*/checkpoints"))
                 for c in list_checkpoints(root)]
        if saved:
            found.append((max(map(LOCAL.modified, saved)), d, max(map(step_of, saved))))
    return [(d, step) for _, d, step in sorted(found, key=lambda f: f[0], reverse=True)[:n]]


def remove_if_refused(run_dir: str) -> None:
    """A run refused before it wrote anything: remove its directory when it was made for this
    run and holds only what Hydra and the lock put there, and the empty parents made with it."""
    path, made = Path(run_dir).absolute(), generated_part(run_dir)
    if made is not None:  # runs/<name>/<id>: up to the working directory (or the id's parent)
        cwd = Path.cwd()
        stop = cwd if cwd in path.parents else made.absolute().parent
    elif _absent is not None and path == _absent[0]:
        stop = _absent[1]
    else:
        return
    if not path.is_dir() or not {p.name for p in path.iterdir()} <= _LEFT_BY_A_REFUSED_RUN:
        return  # something of this run was written: kept
    for name in _LEFT_BY_A_REFUSED_RUN:
        entry = path / name
        for f in entry.iterdir() if entry.is_dir() else ():
            f.unlink()
        entry.rmdir() if entry.is_dir() else entry.unlink(missing_ok=True)
    while path != stop and path.is_dir() and not any(path.iterdir()):
        path.rmdir()
        path = path.parent


def _shown(path: Path) -> str:
    """`path` as the user would type it: relative to the working directory when inside it."""
    try:
        return os.path.relpath(path) if Path.cwd() in path.absolute().parents else str(path)
    except ValueError:
        return str(path)
