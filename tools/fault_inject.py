#!/usr/bin/env python
"""Fault injection: kill, corrupt, fill the disk and signal real `saferun run` jobs at random
points, resume each one, and compare it bitwise with an uninterrupted run.

    python tools/fault_inject.py                      # one case per kind, about 5 minutes
    python tools/fault_inject.py --runs 100 --seed 7  # more cases (kinds in turn)
    python tools/fault_inject.py --kinds sigterm-group,bitflip --context spawn

The job is the digits recipe with slow steps (so that signals land mid-step and during
validation), 2 DataLoader workers drawing random shifts, EarlyStopping and save_best, a
checkpoint every 4 steps with keep_last=2. Each case runs it once with a fault, then once
more with resume=auto and no fault, and classifies the outcome:

  exact        the resumed run ends bitwise equal to the uninterrupted one (weights, buffers,
               optimizer, scheduler, RNG states, callback state, logged metrics, model.pt),
               resuming from the newest complete checkpoint
  refused      the run or its resume stopped with a clear `saferun: error:` (no traceback)
  unclear      an error without a clear message (a traceback, torch's internal message)
  silent loss  the resume exits 0 but its result differs, or it resumed from an older
               checkpoint than the newest complete one, or trained from step 0 although
               checkpoints existed

The course-kill kinds change course instead: `resume=<the oldest checkpoint of a finished
run>` with a lower learning rate and force_resume, killed with SIGKILL at a point of the change
drawn at random (SAFERUN_KILL_AT, see saferun/checkpoint/intent.py and course.py: once the
intent is written as the command line starts, once the model is built, once the change's
record is written, after the n-th rename, after the logs are copied), in that run's directory (course-kill) or in
another one that holds an earlier run (course-kill-other). The resume=auto after it must finish the
change: exact means it ends bitwise equal to the same change made uninterrupted, not to the old course.

Slow and manual: not part of the test suite. Exit status 1 if any case was unclear or a
silent loss. The lead keeps the latest table in docs/fault_injection.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

import torch

from saferun.checkpoint import CheckpointError, list_checkpoints, load_checkpoint

JOB_PY = '''\
"""Digits with slow steps, so that signals land mid-step and during validation."""
import time

from saferun.recipes.digits import DigitsTrainer


class FaultJob(DigitsTrainer):
    def __init__(self, cfg, step_seconds=0.1, val_seconds=0.05):
        super().__init__(cfg)
        self.step_seconds, self.val_seconds = step_seconds, val_seconds

    def training_step(self, batch):
        time.sleep(self.step_seconds)  # the batch is taken, the update not yet made
        return super().training_step(batch)

    def validation_step(self, batch):
        time.sleep(self.val_seconds)
        return super().validation_step(batch)
'''

JOB_YAML = '''\
# @package _global_
# The fault-injection job (tools/fault_inject.py)
defaults:
  - override /model: digits
  - override /data: digits
  - override /callbacks: early_stopping
name: faultjob
task:
  _target_: faultjob.FaultJob
  step_seconds: {step_seconds}
model:
  channels: 96  # checkpoints of about 2 MB: saves take long enough to be hit
trainer:
  max_steps: {steps}
  batch_size: 64
  num_workers: 2
  multiprocessing_context: {context}
  log_every_n_steps: 5
  val_every_n_steps: 10
  limit_val_batches: 3
  save_every_n_steps: 4
  keep_last: 2
  save_best: val/loss
  progress_bar: false
'''

KINDS = ["sigkill", "sigkill-in-save", "bitflip", "truncate", "corrupt-all", "disk-full",
         "sigterm-main", "sigterm-group", "sigint-group", "double-sigint", "course-kill",
         "course-kill-other"]
COURSE_CHANGE = ("optim.lr=3e-4", "force_resume=true")  # the new course: a lower learning rate
# before the change's record (the intent written as the command line starts; the model built),
# then the change itself
COURSE_POINTS = ["course-startup", "course-built", "course-intent", "course-copied",
                 *(f"course-rename-{n}" for n in range(1, 9))]
OUTCOMES = ["exact", "refused", "unclear", "silent loss"]


class Run:
    """One `saferun run` in a session of its own (so that killpg reaches it and its workers),
    its output collected by a thread, its checkpoint directory watched by another."""

    def __init__(self, job_dir: Path, run_dir: Path, *overrides: str,
                 env: Optional[dict[str, str]] = None) -> None:
        self.run_dir = run_dir
        self.published: set[int] = set()  # steps seen as step-* directories
        self.saving = threading.Event()  # a temporary checkpoint directory was seen
        self.lines: list[str] = []
        self.started = time.time()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "saferun", "run", "-cd", str(job_dir), "recipe=faultjob",
             f"hydra.run.dir={run_dir}", *overrides],
            cwd=job_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True, env={**os.environ, **(env or {})})
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._watch, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def _watch(self) -> None:
        root = self.run_dir / "checkpoints"
        while self.proc.poll() is None:
            try:
                for entry in os.scandir(root):
                    if published := re.fullmatch(r"step-(\d+)", entry.name):
                        self.published.add(int(published.group(1)))
                    elif entry.name.startswith(".tmp") or ".replaced-" in entry.name:
                        self.saving.set()  # a save in progress
            except OSError:
                pass
            time.sleep(0.003)

    def wait(self, timeout: float = 600) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal_group(signal.SIGKILL)
            self.proc.wait()
            self.lines.append(f"[fault_inject] killed after {timeout} s\n")
            return -999

    def signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.proc.pid, signum)
        except ProcessLookupError:
            pass

    def signal_main(self, signum: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signum)

    def sleep_until(self, seconds: float) -> bool:
        """Sleep until `seconds` after the start; False if the run ended first."""
        while time.time() - self.started < seconds:
            if self.proc.poll() is not None:
                return False
            time.sleep(0.01)
        return self.proc.poll() is None

    @property
    def text(self) -> str:
        return "".join(self.lines)


class Injector:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args, self.work = args, work
        self.rng = random.Random(args.seed)
        self.job_dir = work / "job"
        (self.job_dir / "recipe").mkdir(parents=True)
        (self.job_dir / "faultjob.py").write_text(JOB_PY)
        (self.job_dir / "recipe" / "faultjob.yaml").write_text(JOB_YAML.format(
            steps=args.steps, step_seconds=args.step_seconds, context=args.context))
        started = time.time()
        ref = Run(self.job_dir, work / "reference")
        if ref.wait() != 0:
            raise SystemExit(f"the uninterrupted run failed:\n{ref.text}")
        self.seconds = time.time() - started
        self.reference = final_state(work / "reference")
        self.state_bytes = (list_checkpoints(work / "reference" / "checkpoints")[-1]
                            / "state.pt").stat().st_size
        self._changed: Optional[dict[str, Any]] = None  # the change of course, uninterrupted

    # ------------------------------------------------------------------ changes of course

    def course(self, kind: str, run_dir: Path) -> tuple[Run, str]:
        """Change course to the oldest checkpoint of a finished run (a copy of the reference),
        killed at a point drawn at random; return the run and the point. course-kill-other:
        `run_dir` holds an earlier run of its own (another copy), which goes aside."""
        first = run_dir if kind == "course-kill" else self.work / "course-first"
        for path in {first, run_dir}:
            if not path.exists():
                shutil.copytree(self.work / "reference", path)
        path = list_checkpoints(first / "checkpoints")[0]
        point = self.rng.choice(COURSE_POINTS)
        run = Run(self.job_dir, run_dir, f"resume={path}", *COURSE_CHANGE,
                  env={"SAFERUN_KILL_AT": point})
        run.wait()
        return run, point

    def changed(self) -> dict[str, Any]:
        """The final state of the same change of course, uninterrupted."""
        if self._changed is None:
            run_dir = self.work / "course-uninterrupted"
            shutil.copytree(self.work / "reference", run_dir)
            path = list_checkpoints(run_dir / "checkpoints")[0]
            run = Run(self.job_dir, run_dir, f"resume={path}", *COURSE_CHANGE)
            if run.wait() != 0:
                raise SystemExit(f"the uninterrupted change of course failed:\n{run.text}")
            self._changed = course_state(run_dir)
        return self._changed

    def course_resume(self, run_dir: Path, point: str) -> tuple[str, str]:
        """resume=auto after a change of course was killed: it must finish that change."""
        resume = Run(self.job_dir, run_dir, "resume=auto", *COURSE_CHANGE)
        status = resume.wait()
        if status != 0:
            kind = "unclear" if unclear(resume.text) or "saferun: error:" not in resume.text \
                else "refused"
            return kind, f"killed at {point}; the resume ({status}): {last_error(resume.text)}"
        difference = compare(course_state(run_dir), self.changed())
        if difference:
            return "silent loss", f"killed at {point}; the resume continued another course: {difference}"
        if (run_dir / ".course-change.json").exists() or (run_dir / ".course-intent.json").exists():
            return "silent loss", f"killed at {point}; the record of the change is left"
        return "exact", f"killed at {point}; the change was finished"

    # ------------------------------------------------------------------ faults

    def fault(self, kind: str, run_dir: Path) -> tuple[Run, set[int]]:
        """Run the job with the fault; return the run and the steps whose checkpoints the
        fault itself destroyed (corruption), which a resume cannot be expected to use."""
        rng, run = self.rng, Run(self.job_dir, run_dir)
        at = rng.uniform(0.0, self.seconds)
        if kind == "sigkill":
            if run.sleep_until(at):
                run.signal_group(signal.SIGKILL)
        elif kind == "sigkill-in-save":
            run.sleep_until(rng.uniform(0.0, 0.8 * self.seconds))
            run.saving.clear()
            while run.proc.poll() is None and not run.saving.wait(0.01):
                pass
            run.signal_group(signal.SIGKILL)
        elif kind in ("sigterm-main", "sigterm-group", "sigint-group", "double-sigint"):
            if run.sleep_until(at):
                send = run.signal_main if kind == "sigterm-main" else run.signal_group
                send(signal.SIGINT if "sigint" in kind else signal.SIGTERM)
                if kind == "double-sigint":
                    time.sleep(rng.uniform(0.0, 1.0))
                    run.signal_group(signal.SIGINT)
        elif kind == "disk-full":
            # RLIMIT_FSIZE on the running process, once it has a checkpoint: from then on no
            # file may grow beyond `limit`, which is below a checkpoint's size but above the logs'.
            limit = rng.randint(256 * 1024, self.state_bytes - 1)
            while run.proc.poll() is None and not run.published:
                time.sleep(0.01)
            if run.sleep_until(time.time() - run.started + rng.uniform(0.0, 0.5 * self.seconds)):
                try:
                    resource.prlimit(run.proc.pid, resource.RLIMIT_FSIZE, (limit, limit))
                except ProcessLookupError:
                    pass  # it ended meanwhile
        else:  # corruption: stop the run at a random point after a checkpoint exists
            while run.proc.poll() is None and not run.published:
                time.sleep(0.01)
            if run.sleep_until(time.time() - run.started + rng.uniform(0.0, 0.5 * self.seconds)):
                run.signal_group(signal.SIGKILL)
        run.wait()
        destroyed = self.corrupt(kind, run_dir) if kind in ("bitflip", "truncate", "corrupt-all") \
            else set()
        return run, destroyed

    def corrupt(self, kind: str, run_dir: Path) -> set[int]:
        found = list_checkpoints(run_dir / "checkpoints")
        if not found:
            return set()
        if kind == "corrupt-all":
            targets = [(p, "state.pt") for p in found]
        else:
            newest = self.rng.random() < 0.7
            target = found[-1] if newest else self.rng.choice(found)
            targets = [(target, self.rng.choice(["state.pt", "manifest.json"]))]
        for directory, name in targets:
            path = directory / name
            data = bytearray(path.read_bytes())
            if kind == "truncate":
                data = data[:self.rng.randrange(len(data))]
            else:
                bit = self.rng.randrange(8 * len(data))
                data[bit // 8] ^= 1 << (bit % 8)
            path.write_bytes(bytes(data))
        return {step_of(p) for p, _ in targets}

    # ------------------------------------------------------------------ one case

    def case(self, number: int, kind: str) -> tuple[str, str]:
        run_dir = self.work / f"case-{number:03d}-{kind}"
        if kind.startswith("course-"):
            run, point = self.course(kind, run_dir)
            outcome, detail = self.course_resume(run_dir, point)
        else:
            run, destroyed = self.fault(kind, run_dir)
            outcome, detail = self.resume(run, run_dir, destroyed)
        if unclear(run.text) and outcome in ("exact", "refused"):
            return "unclear", f"the faulted run: {last_error(run.text)} (then {outcome}: {detail})"
        return outcome, f"[faulted run: status {run.proc.returncode}] {detail}"

    def resume(self, run: Run, run_dir: Path, destroyed: set[int]) -> tuple[str, str]:
        """Resume after the fault (resume=auto, no fault) and classify the result."""
        newest = newest_complete(run_dir, run.published - destroyed)
        resume = Run(self.job_dir, run_dir, "resume=auto")
        status = resume.wait()
        if status != 0:
            if unclear(resume.text) or "saferun: error:" not in resume.text:
                return "unclear", f"the resume ({status}): {last_error(resume.text)}"
            return "refused", f"the resume: {last_error(resume.text)}"
        match = re.search(r"Resumed from \S+: step (\d+)", resume.text)
        resumed = int(match.group(1)) if match else 0
        if resumed < newest:
            return "silent loss", (f"resumed from step {resumed} although a complete "
                                   f"checkpoint of step {newest} existed")
        if match is None and (destroyed or run.published):
            return "silent loss", ("trained from step 0 although checkpoints existed "
                                   f"(steps {sorted(run.published)}, destroyed {sorted(destroyed)})")
        difference = compare(final_state(run_dir), self.reference)
        if difference:
            return "silent loss", f"resumed from step {resumed}; differs: {difference}"
        return "exact", f"resumed from step {resumed}" if match else "nothing to resume"


# ---------------------------------------------------------------------- checks


def step_of(checkpoint: Path) -> int:
    found = re.match(r"step-(\d+)", checkpoint.name)
    assert found, checkpoint
    return int(found.group(1))


def final_state(run_dir: Path) -> dict[str, Any]:
    """The final checkpoint's state, without what differs by design (paths, timings)."""
    found = list_checkpoints(run_dir / "checkpoints")
    state = load_checkpoint(found[-1]) if found else {}
    state.pop("config", None)
    state.pop("provenance", None)
    loop = state.get("loop", {})
    if loop.get("best"):
        loop["best"] = [loop["best"][0], Path(loop["best"][1]).name]
    weights = run_dir / "model.pt"
    state["model.pt"] = torch.load(weights, weights_only=True) if weights.exists() else None
    return without_timings(state)


def course_state(run_dir: Path) -> dict[str, Any]:
    """`final_state` with metrics.jsonl's lines instead of its length in bytes: the lines of
    a changed course were written by several processes, and their wall-clock times (and so
    the length) differ from those of the uninterrupted change."""
    state = final_state(run_dir)
    for saved in state.get("callbacks", {}).values():
        if isinstance(saved, dict):
            saved.pop("length", None)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    state["metrics.jsonl"] = [without_timings({k: v for k, v in json.loads(line).items() if k != "time"})
                              for line in lines]
    return state


def without_timings(obj: Any) -> Any:
    """`obj` without the perf/ entries (timings) wherever they are kept."""
    if isinstance(obj, dict):
        return {k: without_timings(v) for k, v in obj.items() if not str(k).startswith("perf/")}
    return obj


def compare(a: Any, b: Any, path: str = "") -> Optional[str]:
    """The first difference between two nested states (tensors bitwise), or None."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and \
            a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return None if same else path
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{path} keys {sorted(set(a) ^ set(b))}"
        return next((d for k in a if (d := compare(a[k], b[k], f"{path}.{k}"))), None)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := compare(x, y, f"{path}[{i}]"))),
                    None)
    return None if a == b else f"{path} ({a!r} != {b!r})"


def newest_complete(run_dir: Path, published: set[int]) -> int:
    """The newest step, among those once published, of which a complete checkpoint exists
    now, under its name or a temporary one (0 if none)."""
    newest = 0
    root = run_dir / "checkpoints"
    for path in root.iterdir() if root.is_dir() else ():
        try:
            step = load_checkpoint(path)["loop"]["step"]
        except (CheckpointError, OSError, KeyError, TypeError, ValueError, RuntimeError):
            continue
        if step in published:
            newest = max(newest, step)
    return newest


def unclear(text: str) -> bool:
    """An error without saferun's explanation. A KeyboardInterrupt traceback is Python's own
    answer to a Ctrl-C before training started (nothing to save yet), so it is not one."""
    tracebacks = text.count("Traceback")
    if tracebacks and tracebacks == len(re.findall(r"^KeyboardInterrupt\s*$", text, re.M)):
        tracebacks = 0
    return bool(tracebacks) or "enforce fail" in text or "Error executing job" in text


def last_error(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    said = [line for line in lines if "saferun: error:" in line or "Error" in line]
    return (said or lines or ["(no output)"])[-1][:300]


# ---------------------------------------------------------------------- main


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=len(KINDS), help="fault cases (default: one per kind)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated: {', '.join(KINDS)}")
    parser.add_argument("--steps", type=int, default=30, help="max_steps of the job (22 per epoch)")
    parser.add_argument("--step-seconds", type=float, default=0.1)
    parser.add_argument("--context", default="fork", choices=["fork", "spawn", "forkserver"])
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    args = parser.parse_args(argv)
    kinds = args.kinds.split(",")
    unknown = set(kinds) - set(KINDS)
    if unknown:
        parser.error(f"unknown kinds {sorted(unknown)}; choose from {', '.join(KINDS)}")
    work = Path(tempfile.mkdtemp(prefix="saferun-faults-"))
    started = time.time()
    try:
        injector = Injector(args, work)
        print(f"uninterrupted run: {injector.seconds:.1f} s; {args.runs} cases, seed {args.seed}, "
              f"{args.context} workers, work directory {work}", flush=True)
        order = [kind for _ in range(-(-args.runs // len(kinds)))
                 for kind in injector.rng.sample(kinds, len(kinds))][:args.runs]
        table: dict[str, collections.Counter[str]] = {k: collections.Counter() for k in kinds}
        notes = []
        for number, kind in enumerate(order, 1):
            outcome, detail = injector.case(number, kind)
            table[kind][outcome] += 1
            print(f"  #{number:3d} {kind:<16} {outcome:<12} {detail}", flush=True)
            if outcome != "exact":
                notes.append(f"#{number} {kind}: {outcome}: {detail}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(render(table, args, time.time() - started))
    if notes:
        print("\nNot exact:\n" + "\n".join(f"  {n}" for n in notes))
    bad = sum(c["unclear"] + c["silent loss"] for c in table.values())
    return 1 if bad else 0


def render(table: dict[str, collections.Counter[str]], args: argparse.Namespace,
           seconds: float) -> str:
    rows = [["kind", "runs", *OUTCOMES]]
    total: collections.Counter[str] = collections.Counter()
    for kind, counts in table.items():
        if sum(counts.values()):
            rows.append([kind, str(sum(counts.values())), *(str(counts[o]) for o in OUTCOMES)])
            total.update(counts)
    rows.append(["total", str(sum(total.values())), *(str(total[o]) for o in OUTCOMES)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths))) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    kinds = "" if args.kinds == ",".join(KINDS) else f" --kinds {args.kinds}"
    header = (f"\nsaferun fault injection: `python tools/fault_inject.py --runs {args.runs} "
              f"--seed {args.seed} --context {args.context}{kinds}` ({seconds / 60:.1f} minutes)\n")
    return header + "\n".join(lines)


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
