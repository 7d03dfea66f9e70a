"""Changing course: `resume=PATH` from an older checkpoint of this run directory, or from a
checkpoint of another run directory.

What the superseded course left in this run directory (its checkpoints after PATH, or, when PATH
lies elsewhere, every one; its metrics.jsonl, TensorBoard events and HParams entry, model.pt,
summary.json, config.yaml, .hydra/, text log and the entries the callbacks own, `run_files`:
a tracker's run id and offline files) moves into `<run dir>/superseded-<time>/`,
nothing deleted. The continued course then gets the logs of its own past, PATH's course up to
PATH's step (metrics.jsonl lines, TensorBoard events), so its curves run on without a gap and a
run directory never holds two courses.

Crash safety: before anything moves, `<run dir>/.course-change.json` records the checkpoint
resumed from, the folder and every entry to move (written atomically). Each move is a rename
done only while its source is there and its destination is not, so carrying out the record
again finishes what a killed run left half done. A later `resume=auto` (or the same
`resume=PATH`) finds the record, finishes the change and resumes from the recorded checkpoint.
The record is removed once the run directory holds the continued course's first checkpoint.
Before the record, from the moment the run knows PATH, `intent.py`'s `.course-intent.json`
makes the change durable: a run killed before its record leaves the intent, which a later
`resume=auto` carries out.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from ..errors import SaferunError
from .. import distributed
from .intent import drop_intent, kill_point as _kill_point
from .store import CheckpointError, list_checkpoints, step_of
from .superseded import close_log_files, earlier_files, fsync_dir, keep_this_runs_lines

RECORD = ".course-change.json"
_KEYS = {"resumed", "step", "aside", "move", "logs_from"}


def interrupted(run_dir: str) -> Optional[dict[str, Any]]:
    """The record of a change of course a killed run left unfinished in `run_dir`, or None."""
    path = Path(run_dir) / RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} (the record of an interrupted change of course) is "
                              f"unreadable ({e}). See its superseded-* folder and checkpoints; "
                              f"set resume=PATH to the checkpoint to continue from.") from None
    if not isinstance(record, dict) or set(record) != _KEYS:
        raise CheckpointError(f"{path} (the record of an interrupted change of course) is "
                              f"damaged: it has not exactly the keys {', '.join(sorted(_KEYS))}.")
    return record


def refuse_other_start(run_dir: str, resume: Optional[str], record: dict[str, Any]) -> None:
    """A start that is not the interrupted change's own (`resume` unset, fresh, or another
    PATH) is refused while the record is there: the run directory is half moved."""
    raise SaferunError(
        f"the run directory {run_dir} holds an unfinished change of course (a run with "
        f"resume={record['resumed']} was killed while moving the earlier course into "
        f"{record['aside']}/; the record is {RECORD}), and this run has resume={resume}. Run "
        f"with resume=auto first: it finishes that change and continues from "
        f"{record['resumed']}; then start what you meant.")


def change_course(run_dir: str, resumed: Path, step: int, main: bool,
                  owned: Sequence[str] = ()) -> Optional[dict[str, Any]]:
    """Set aside what a run resumed from `resumed` (step `step`) supersedes in `run_dir` (the
    callbacks' `owned` entries too), or finish an interrupted change; return the record
    (None: nothing supersedes). Rank 0 moves; every rank gets the record or the error. The
    caller calls `finished` once the run directory holds a checkpoint of the continued course."""
    record, error = None, None
    if main:
        try:
            record = interrupted(run_dir) or _plan(Path(run_dir), resumed, step, owned)
            if record is not None:
                _write_record(Path(run_dir), record)
                _kill_point("course-intent")
                _carry_out(Path(run_dir), record)
        except SaferunError as e:
            error = str(e)
        except OSError as e:
            error = (f"could not move the superseded course in {run_dir} aside ({e.strerror or e}) "
                     f"for resume={resumed}. What was moved is in its superseded-* folder and "
                     f"{RECORD} records the rest: fix the cause, then resume=auto finishes it.")
    record, error = distributed.broadcast((record, error))
    if error is not None:
        raise SaferunError(error)
    if record is None:  # nothing supersedes: the intent is done (else with the record, below)
        drop_intent(run_dir, main)
    return record


def finished(run_dir: str, record: Optional[dict[str, Any]], main: bool) -> None:
    """The continued course has a checkpoint in `run_dir`: the change is complete."""
    if record is not None and main:
        (Path(run_dir) / RECORD).unlink(missing_ok=True)
        fsync_dir(Path(run_dir))
    drop_intent(run_dir, main)


def _plan(run_dir: Path, resumed: Path, step: int, owned: Sequence[str]) -> Optional[dict[str, Any]]:
    root = run_dir / "checkpoints"
    resumed = resumed.resolve()
    inside = resumed.parent == root.resolve()
    files = [p.name for p in earlier_files(run_dir, owned)]
    if inside:
        later = [f"checkpoints/{p.name}" for p in list_checkpoints(root)
                 if p.resolve() != resumed and step_of(p) > step]
        if not later:
            return None  # PATH is this course's newest checkpoint: nothing supersedes
        files = later + [n for n in files if n != "checkpoints"]
    aside = f"superseded-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(2)}"
    # the continued course's past logs: the old course's (now aside), or PATH's run directory's
    logs_from = aside if inside else str(resumed.parent.parent) \
        if resumed.parent.name == "checkpoints" else None
    return {"resumed": str(resumed), "step": step, "aside": aside, "move": files,
            "logs_from": logs_from}


def _write_record(run_dir: Path, record: dict[str, Any]) -> None:
    path = run_dir / RECORD
    if path.is_file():
        return  # an interrupted change's record: carried out again as it is
    tmp = run_dir / f".tmp-course-{secrets.token_hex(4)}"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(run_dir)


def _carry_out(run_dir: Path, record: dict[str, Any]) -> None:
    for pattern in (".tmp-course-*", ".tmp-metrics.jsonl-*", ".tmp-tensorboard-*"):
        for stale in run_dir.glob(pattern):  # left by a killed pass
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
    aside = run_dir / record["aside"]
    moved = []
    for number, name in enumerate(record["move"], 1):
        source, target = run_dir / name, aside / name
        if os.path.lexists(source) and not os.path.lexists(target):
            target.parent.mkdir(parents=True, exist_ok=True)
            close_log_files(source)
            source.rename(target)
            moved.append(target)
            _kill_point(f"course-rename-{number}")
    for folder in {aside, aside / "checkpoints", run_dir / "checkpoints", run_dir}:
        if folder.is_dir():
            fsync_dir(folder)
    keep_this_runs_lines(run_dir, moved)
    if record["logs_from"] is not None:
        past = run_dir / record["logs_from"]
        _copy_jsonl(past / "metrics.jsonl", run_dir / "metrics.jsonl", record["step"])
        _copy_events(past / "tensorboard", run_dir / "tensorboard", record["step"])
    _kill_point("course-copied")


def _copy_jsonl(source: Path, target: Path, step: int) -> None:
    """The lines of `source` up to `step` (its metrics.jsonl logger then cuts them to the
    length recorded in the checkpoint)."""
    if not source.is_file():
        return
    kept = []
    with open(source, "rb") as f:
        for line in f:
            try:
                if not line.endswith(b"\n") or json.loads(line)["step"] > step:
                    break  # a later step, or the torn line of a killed write
            except (ValueError, KeyError, TypeError):
                break
            kept.append(line)
    _publish(target, lambda tmp: tmp.write_bytes(b"".join(kept)))


def _copy_events(source: Path, target: Path, step: int) -> None:
    """`source`'s TensorBoard events up to `step`, without its HParams entry (the continued
    course writes its own), unless `target` is there already."""
    if not source.is_dir() or os.path.lexists(target):
        return
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.record_writer import RecordWriter

    def copy(tmp: Path) -> None:
        tmp.mkdir()
        for file in sorted(source.glob("events.out.tfevents.*")):
            if file.name.endswith(".hparams"):
                continue
            with open(tmp / file.name, "wb") as out:
                writer = RecordWriter(out)
                for record in RawEventFileLoader(str(file)).Load():  # as written, unconverted
                    if Event.FromString(record).step <= step:
                        writer.write(record)
                out.flush()
                os.fsync(out.fileno())

    _publish(target, copy)


def _publish(target: Path, write: Any) -> None:
    tmp = target.with_name(f".tmp-{target.name}-{secrets.token_hex(4)}")
    try:
        write(tmp)
        os.replace(tmp, target)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp)
        else:
            tmp.unlink(missing_ok=True)
    fsync_dir(target.parent)

