"""The lifecycle grid's runs: each event once, every component on, shared by every cell that
reads it (a session-wide cache). All run directories are siblings under one root, so they
share the default MLflow store (sqlite:///<root>/mlflow.db) as runs of one name do."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from grid_job import JOB_PATH, config, run_in_process
from helpers import free_port
from saferun.errors import SaferunError
from saferun.preemption import Preempted

TIMEOUT = 240  # a hang fails its cells instead of the suite
BAD_STEP = 11  # the NaN loss: after the best checkpoint of step 9 and the log point at 10
CORRUPT_STEP = 8  # a parameter made infinite by a step whose loss and gradients are finite,
# at a log point and a save: the next step's loss is NaN
COURSE_FROM = 8  # resume=PATH goes back to this step's checkpoint, with another learning rate
COURSE_LR = 0.1


@dataclass
class Outcome:
    """What an event left: its run directory, the trainer that ended it (in-process), the
    error it ended with (refused), and the directories it compares with."""

    run_dir: Path
    job: Any = None
    error: Optional[BaseException] = None
    old: Optional[Path] = None  # the run directory of the course it replaced, if elsewhere
    notes: dict[str, Any] = field(default_factory=dict)


def subprocess_run(cfg: dict[str, Any], plant: dict[str, Any], nproc: int = 0) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    env.pop("WANDB_SERVICE", None)  # its own W&B service, as a fresh process has: this
    # process's service would keep a killed run's id in use
    launcher = ([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                 f"--master_port={free_port()}"] if nproc else [sys.executable])
    return subprocess.run([*launcher, JOB_PATH, json.dumps(cfg), json.dumps(plant)],
                          capture_output=True, text=True, timeout=TIMEOUT, env=env)


def flush_wandb() -> None:
    """W&B's service writes the transaction log on its own: wait for it before reading (the
    next run starts a new service, so only the cells that read W&B wait)."""
    import wandb

    wandb.teardown()


class Runs:
    """Runs each event on first use and keeps its Outcome for the session."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._done: dict[str, Outcome] = {}
        self._failed: dict[str, BaseException] = {}

    def __getitem__(self, event: str) -> Outcome:
        if event in self._failed:  # once: its directory holds what the failed attempt left
            raise AssertionError(f"the event {event} failed (see its first cell)") from self._failed[event]
        if event not in self._done:
            try:
                self._done[event] = EVENTS[event](self, self.root / event)
            except BaseException as e:
                self._failed[event] = e
                raise
        return self._done[event]


def _resumed(run_dir: Path, **kw: Any) -> Outcome:
    """resume=auto in this process; what saferun warned is in notes["warnings"]."""
    import logging

    cfg = config(run_dir, **kw)
    cfg["resume"] = "auto"
    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("saferun").addHandler(handler)
    try:
        return Outcome(run_dir, job=run_in_process(cfg), notes={"warnings": said})
    finally:
        logging.getLogger("saferun").removeHandler(handler)


def reference(runs: Runs, run_dir: Path, sched: str = "cosine") -> Outcome:
    return Outcome(run_dir, job=run_in_process(config(run_dir, sched=sched)))


def sigkill(plant: dict[str, int]) -> Callable[[Runs, Path], Outcome]:
    def event(runs: Runs, run_dir: Path) -> Outcome:
        killed = subprocess_run(config(run_dir), plant)
        assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
        return _resumed(run_dir)
    return event


def sigterm(runs: Runs, run_dir: Path, sched: str = "cosine") -> Outcome:
    try:
        run_in_process(config(run_dir, sched=sched), term_at=7)
    except Preempted:
        pass
    else:
        raise AssertionError("the SIGTERM at step 7 did not stop the run")
    return _resumed(run_dir, sched=sched)


def course_reference(runs: Runs, run_dir: Path) -> Outcome:
    """What a new course from step 8 with lr 0.1 holds: stopped by SIGTERM during step 8 and
    resumed there with the new rate (force_resume), a plain resume that keeps one timeline."""
    try:
        run_in_process(config(run_dir), term_at=COURSE_FROM)
    except Preempted:
        pass
    cfg = config(run_dir)
    cfg["optim"]["lr"] = COURSE_LR
    cfg.update(resume="auto", force_resume=True)
    return Outcome(run_dir, job=run_in_process(cfg))


def _change_course(source: Path, run_dir: Path) -> Outcome:
    cfg = config(run_dir)
    cfg["optim"]["lr"] = COURSE_LR
    cfg.update(resume=str(source / "checkpoints" / f"step-{COURSE_FROM:08d}"), force_resume=True)
    try:
        return Outcome(run_dir, job=run_in_process(cfg), old=source)
    except SaferunError as e:
        return Outcome(run_dir, error=e, old=source)


def course_same_dir(runs: Runs, run_dir: Path) -> Outcome:
    run_in_process(config(run_dir))  # the old course: the reference's, to its end
    return _change_course(run_dir, run_dir)


def course_other_dir(runs: Runs, run_dir: Path) -> Outcome:
    source = runs.root / "course_source"
    run_in_process(config(source))
    return _change_course(source, run_dir)


def fresh(runs: Runs, run_dir: Path) -> Outcome:
    try:
        run_in_process(config(run_dir), term_at=7)  # an earlier run, stopped with a checkpoint
    except Preempted:
        pass
    cfg = config(run_dir)
    cfg["resume"] = "fresh"
    return Outcome(run_dir, job=run_in_process(cfg))


def second_fit(runs: Runs, run_dir: Path, sched: str = "cosine") -> Outcome:
    try:
        return Outcome(run_dir, job=run_in_process(config(run_dir, sched=sched, max_steps=6),
                                                   second_max_steps=12))
    except SaferunError as e:
        return Outcome(run_dir, error=e)


def two_ranks(runs: Runs, run_dir: Path) -> Outcome:
    proc = subprocess_run(config(run_dir, ranks=2), {}, nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return Outcome(run_dir)


def nonfinite(policy: str, plant: str = "nan_at", step: int = BAD_STEP) -> Callable[[Runs, Path], Outcome]:
    def event(runs: Runs, run_dir: Path) -> Outcome:
        cfg = config(run_dir)
        cfg["guards"]["nonfinite"] = policy  # (the spike guard stays on)
        good = {"last good log point": step - 1 if plant == "nan_at" else step}
        try:
            return Outcome(run_dir, job=run_in_process(cfg, **{plant: step}), notes=good)
        except SaferunError as e:
            return Outcome(run_dir, error=e, notes=good)
    return event


EVENTS: dict[str, Callable[[Runs, Path], Outcome]] = {
    "reference": reference,
    "sigkill": sigkill({"kill_at": 11}),  # after the best checkpoint of 9 and the log point at 10
    "sigkill_in_validation": sigkill({"kill_in_validation_at": 12}),  # step 12 logged, validating
    "sigkill_before_checkpoint": sigkill({"kill_at": 3}),  # step 2 logged, nothing saved (the
    # validation at 3 saves the first, the best)
    "sigterm": sigterm,
    "course_same_dir": course_same_dir,
    "course_other_dir": course_other_dir,
    "course_reference": course_reference,
    "fresh": fresh,
    "second_fit": second_fit,
    "two_ranks": two_ranks,
    "nonfinite_raise": nonfinite("raise"),
    "nonfinite_skip": nonfinite("skip"),
    "nonfinite_rollback": nonfinite("rollback"),
    "nonfinite_off": nonfinite("off"),
    "nonfinite_param": nonfinite("raise", "corrupt_at", CORRUPT_STEP),
    "nonfinite_param_rollback": nonfinite("rollback", "corrupt_at", CORRUPT_STEP),
    "plateau_reference": lambda runs, d: reference(runs, d, sched="plateau"),
    "plateau_sigterm": lambda runs, d: sigterm(runs, d, sched="plateau"),
    "plateau_second_fit": lambda runs, d: second_fit(runs, d, sched="plateau"),
}
