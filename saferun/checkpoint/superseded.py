"""An earlier timeline in the run directory is set aside, never mixed with this run's, never
deleted: `move_aside` is the one place that moves it, into `<dir>/superseded-<time>/`.

- `course.change_course`: a resume from an older checkpoint (or from another directory) moves
  the course it supersedes (its checkpoints and logs) the same way.
- `start_fresh`: a run that starts from step 0 where an earlier run left its files. With that
  run's checkpoints there and `resume` unset, the user most likely forgot `resume=auto`: refused,
  naming what is there. With `resume=fresh`, or when the earlier run left only logs (it crashed
  before its first checkpoint), that run's checkpoints and logs are moved aside, so this run's
  metrics.jsonl, TensorBoard events and text log hold this run alone.

Besides RUN_FILES, the entries a callback declares in its `run_files` (a tracker's run id, its
offline files) move aside with the course they belong to; the callback then hears where they
went (`on_fresh_start`, `on_course_change`; see saferun/callbacks.py).
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from pathlib import Path
from typing import Optional, Sequence

from ..errors import SaferunError
from .. import distributed
from . import rundir
from .intent import fsync_dir
from .store import list_checkpoints, step_of

log = logging.getLogger("saferun")

FRESH = "fresh"  # resume=fresh: start over here, the earlier run's files moved aside
# What a run writes in its run directory (saferun.log: the command line's text log, Hydra's
# job log). .hydra/ too where the command line writes it once this run is accepted (not if
# Hydra wrote it before the job, hydra.output_subdir set by the user: then it is this run's).
RUN_FILES = ("checkpoints", "tensorboard", "metrics.jsonl", "saferun.log", "config.yaml",
             "summary.json", "model.pt", "model_ema.pt", "model_best.pt", "model_ema_best.pt")


def move_aside(parent: Path, paths: Sequence[Path]) -> Optional[Path]:
    """Move `paths` (entries of `parent`) into a new `parent/superseded-<time>-<hex>/` by
    renames; return it, or None when there is nothing to move."""
    if not paths:
        return None
    aside = parent / f"superseded-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(2)}"
    aside.mkdir()
    moved: list[Path] = []
    try:
        for path in paths:
            close_log_files(path)
            path.rename(aside / path.name)
            moved.append(path)
    except OSError:  # all or nothing: put back what was moved
        for path in moved:
            (aside / path.name).rename(path)
        aside.rmdir()
        raise
    keep_this_runs_lines(parent, [aside / path.name for path in moved])
    fsync_dir(parent)
    return aside


def keep_this_runs_lines(parent: Path, moved: Sequence[Path]) -> None:
    """This run's first lines, logged to a file of `parent` before it was `moved` aside,
    stay with this run: they go back into a new file of that name."""
    for path in moved:
        start = log_starts.get(str((parent / path.name).absolute()))
        if start is not None:
            with open(path, "r+b") as f:
                f.seek(start)
                mine = f.read()
                f.truncate(start)
            (parent / path.name).write_bytes(mine)


def start_fresh(run_dir: str, resume: Optional[str], main: bool,
                owned: Sequence[str] = ()) -> Optional[str]:
    """This run starts from step 0 in `run_dir`: refuse it over another run's checkpoints
    unless `resume` is `fresh`; move an earlier run's files (RUN_FILES and the callbacks'
    `owned` entries) aside and return the folder they went to (None: nothing there). Rank 0
    decides and moves (under the run directory's lock); every rank gets the verdict before
    any writes."""
    error, cause, aside = None, None, None
    if main:
        try:
            aside = _clear(Path(run_dir), resume, owned)
        except SaferunError as e:
            error = str(e)
        except OSError as e:
            error = (f"could not move the earlier run's files in {run_dir} aside "
                     f"({e.strerror or e}): nothing of this run was written. Fix the "
                     f"permissions or use another run directory.")
        except Exception as e:  # anything else: every rank still gets the verdict, none waits
            error, cause = f"checking the run directory {run_dir} failed: {type(e).__name__}: {e}", e
    error, aside = distributed.broadcast((error, aside))
    if error is not None:
        raise SaferunError(error) from cause
    return aside


def _clear(path: Path, resume: Optional[str], owned: Sequence[str]) -> Optional[str]:
    found = list_checkpoints(path / "checkpoints")
    if found and resume != FRESH:
        raise SaferunError(
            f"the run directory {path} holds the checkpoints of another run (the latest: step "
            f"{step_of(found[-1])}, {found[-1]}) and this run starts from step 0 (resume is not "
            f"set): it would overwrite them step by step, append its logs to theirs, and a "
            f"later resume=auto could pick their newer checkpoint. To continue that run, set "
            f"resume=auto. To start over here, set resume=fresh: its checkpoints and logs are "
            f"moved into {path}/superseded-<time>/ (nothing is deleted). Or use another run "
            f"directory (hydra.run.dir=... on the command line, trainer.run_dir in Python).")
    earlier = earlier_files(path, owned)
    aside = move_aside(path, earlier)
    if aside is not None:
        why = "resume=fresh" if resume == FRESH else \
            f"resume={resume}: no checkpoint, but an earlier attempt's logs" if resume else \
            "no checkpoint, but an earlier attempt's logs"
        log.warning("Starting from step 0 (%s): the earlier run's %s moved to %s, nothing "
                    "deleted; this run's logs start empty.", why,
                    ", ".join(p.name for p in earlier), aside)
    return None if aside is None else str(aside)


def earlier_files(path: Path, owned: Sequence[str] = ()) -> list[Path]:
    """The files an earlier run left in the run directory `path` (RUN_FILES, the callbacks'
    `owned` entries, and .hydra/ where this run writes its own)."""
    names = RUN_FILES + tuple(n for n in owned if n not in RUN_FILES) + \
        ((".hydra",) if rundir.writes_hydra_dir(str(path)) else ())
    # (a log file this process opened empty, Hydra's saferun.log in a new directory, is this run's)
    return [p for p in (path / name for name in names)
            if p.exists() and log_starts.get(str(p.absolute())) != 0]


def evaluated_weights(entry: str, run_dir: str, resume: Optional[str], untrained_auto: bool,
                      unresumed: bool) -> None:
    """validate()/predict() (`entry`) alone: refuse resume=auto that found nothing; with
    `resume` unset (`unresumed`: step 0, nothing loaded) over a run's checkpoints, say that
    the model as built is evaluated, not them (a fresh start there is refused)."""
    if untrained_auto:
        raise SaferunError(
            f"{entry}(): resume=auto found no checkpoint in {run_dir}, so it would evaluate the "
            f"untrained initial weights. Set resume to the run directory or checkpoint to "
            f"evaluate (e.g. resume=runs/exp1), or resume=null to evaluate the initial weights "
            f"on purpose.")
    found = list_checkpoints(Path(run_dir) / "checkpoints") if unresumed and resume is None else []
    if found and entry == "test":  # test() writes its numbers into this run's logs and summary
        raise SaferunError(
            f"test(): resume is unset, so it would evaluate the model as built (not the "
            f"checkpoints in {run_dir}, the latest: step {step_of(found[-1])}) and write those "
            f"numbers into that run's metrics.jsonl and summary.json. Set resume=auto to test "
            f"the run's latest weights, or use {{YourTrainer}}.from_run({run_dir!r}, 'best') "
            f"to test its best.")
    if found:
        log.warning("%s(): resume is unset, so this evaluates the model as built (its initial "
                    "weights, unless you loaded others), not the checkpoints in %s (the latest: "
                    "step %d). To evaluate those, set resume=auto.", entry, run_dir,
                    step_of(found[-1]))


log_starts: dict[str, int] = {}  # a log file's size when this run began to append to it


def note_log_files() -> None:
    """Remember the size of each log file this process appends to (the command line's
    saferun.log, opened by Hydra), before the run logs anything: if an earlier run's log is
    set aside, the lines this run logged before that come back to this run's log."""
    for handler in _file_handlers():
        if os.path.exists(handler.baseFilename):
            log_starts[handler.baseFilename] = os.path.getsize(handler.baseFilename)


def close_log_files(path: Path) -> None:
    """Close a logging file handler writing to `path`: its next line opens a new file at the
    same name, not the moved one."""
    for handler in _file_handlers():
        if Path(handler.baseFilename) == path.absolute():
            handler.close()


def _file_handlers() -> list[logging.FileHandler]:
    return [h for logger in (logging.getLogger(), log) for h in logger.handlers
            if isinstance(h, logging.FileHandler)]
