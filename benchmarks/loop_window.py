"""The whole loop's fixed cost: saferun's `fit()` against a hand-written loop, step window 201-2000.

    python benchmarks/loop_window.py                   # 9 interleaved rounds, fresh processes
    python benchmarks/loop_window.py --lockstep 100    # 9 rounds, the variants in turns on one core
    python benchmarks/loop_window.py --lockstep 100 --rounds 7 --variants hand,lean,saferun,strict
                                                       # and `lean`: the hand loop clipping and
                                                       # zeroing as saferun does (like for like)
    python benchmarks/loop_window.py --lockstep 100 --baseline ../old   # and an older checkout's
                                                       # (git worktree add ../old <commit>)
    python benchmarks/loop_window.py --count           # counts per step: no timing
    python benchmarks/loop_window.py --quick           # a smoke run (seconds)
    python benchmarks/loop_window.py --count --workload cnn --steps 400   # the CNN's counts
    python benchmarks/loop_window.py --instructions    # instructions per step (valgrind)
    python benchmarks/loop_window.py --instructions --variants strict   # one variant's (3 min)

`step_micro.py` times `train_step` alone; this times everything around it too: the batch stream,
the per-step bookkeeping, the callbacks, the log points, the stop checks and the checkpoint
that falls in the window. The job (issue 37): an MLP 32-64-64-10, batch 64, AdamW (lr 1e-3),
gradients clipped at 1.0, one thread (OMP_NUM_THREADS=1 in every child), 2000 steps, no
validation. The hand loop reads its running loss to the host every 100 steps and writes
nothing; saferun runs with its defaults and trainer.log_every_n_steps=100 (variant `saferun`),
and with the three guards `guards=strict` turns on (`strict`: guards.spikes=raise,
guards.check_params=true, guards.anomaly_replay=true).

Each run is a fresh process (imports, allocator and caches start cold for everyone alike); a
round runs the variants once each, in an order that rotates from round to round, so that drift
of the machine falls on all of them. A run's time per step is the wall time from the end of
step 200 to the end of step 2000, divided by 1800 (log points and the checkpoint at step 1000
included; the end of each step is marked by a callback for saferun, inline for the hand loop).
The headline is, per variant, the median over rounds of its ratio to the hand loop of the same
round, with the absolute microseconds per step it adds.

`--lockstep BLOCK` times on a machine whose speed drifts (other tenants of a virtual machine):
the three variants run at once, each a fresh process pinned to the same core, and take turns
of BLOCK steps through the window, passing a token through pipes, so neighbouring turns of
all three see the machine alike; each times only its own turns (every turn holds one log point
when BLOCK is a multiple of 100). A round's ratio is a variant's time over its turns to the
hand loop's over the same turns; each run also reports its median step (no log point, no
checkpoint). Between turns the core's caches hold another variant's data, alike for all.

`--count` replaces the clock with counts that do not depend on the machine's load, per step of
the same window: Python function calls and C calls (`sys.setprofile`), generation-0 garbage
collections per 1000 steps (about one per 700 container objects left allocated: a proxy for
objects built per step), and host syncs (saferun's `HostSyncCounter`, in a separate run).
`--instructions` counts the machine instructions each variant executes per step of a window
(steps 201-400 by default: two log points, no checkpoint), every thread's, under valgrind's
callgrind with instrumentation switched on at the window's first step and off at its last
(`callgrind_control`; the rest of the run is not counted). The count is the same on a quiet and
on a loaded machine, so it measures a change of the loop's work where wall-clock rounds cannot
tell 1 % from noise; it weighs every instruction alike (a cache miss costs nothing in it).

`Window(..., "calls", kept=True)` also counts the container objects a plain step leaves alive,
exactly (the collector paused over the window instead of counting its collections;
tests/loop/test_loop_cost.py holds a budget for it).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = ("hand", "saferun", "strict")
# `lean` (with --lockstep --variants): the hand loop with its clipping and zeroing written the way
# saferun's loop runs them on one device (torch's kernels, bit for bit torch's result, without
# clip_grad_norm_'s and zero_grad's per-call generality): saferun's own cost, like for like
EXTRA = ("lean",)
# spike_threshold 12: the default 6 flags a gradient-norm outlier of this small job near step
# 1600 (and raise ends the run); the threshold changes no work per step.
STRICT = {"spikes": "raise", "check_params": True, "anomaly_replay": True, "spike_threshold": 12.0}
LOG_EVERY = 100


class Window:
    """Marks the end of each step; times (or counts) steps `start`+1 .. `end`."""

    def __init__(self, start: int, end: int, mode: str, kept: bool = False) -> None:
        self.start, self.end, self.mode, self.kept = start, end, mode, kept
        self.step = 0
        self.t0 = self.t1 = 0
        self.calls = self.c_calls = self.gc0 = 0
        self.syncs: Optional[Any] = None  # a HostSyncCounter, in a counted run
        self.ops: Any = None  # an OpCounter, with it
        self.sync_counts: list[int] = []
        self.op_counts: list[int] = []
        self.call_counts: list[int] = []  # Python calls so far, at the end of each step
        self.kept_counts: list[int] = []  # with `kept`: gc-tracked objects alive at each step's end
        self.baton: Optional[Baton] = None  # in a lockstep run

    def tick(self) -> None:
        self.step += 1
        if self.baton is not None:
            if self.start < self.step <= self.end:
                self.baton.stamp()
            if self.start <= self.step <= self.end and (self.step - self.start) % self.baton.block == 0:
                self.baton.turn(first=self.step == self.start, last=self.step == self.end)
            return
        if self.syncs is not None:
            self.sync_counts.append(self.syncs.count)
            self.op_counts.append(self.ops.count)
        if self.mode == "calls" and self.start <= self.step <= self.end:
            self.call_counts.append(self.calls)
        if self.kept:  # the collector paused: its count grows by what steps keep
            if self.step == self.start:
                gc.collect()
                gc.disable()
            if self.start <= self.step <= self.end:
                self.kept_counts.append(gc.get_count()[0])
            if self.step == self.end:
                gc.enable()
        if self.mode == "instructions" and self.step in (self.start, self.end):
            subprocess.run(["callgrind_control", "--instr=" + ("on" if self.step == self.start
                                                              else "off"), str(os.getpid())],
                           check=True, capture_output=True)
        if self.step == self.start:
            self.r0 = resource.getrusage(resource.RUSAGE_SELF)
            self.t0 = time.perf_counter_ns()
            if self.mode == "calls":
                gc.callbacks.append(self._gc)
                sys.setprofile(self._profile)
        elif self.step == self.end:
            if self.mode == "calls":
                sys.setprofile(None)
                gc.callbacks.remove(self._gc)
            self.t1 = time.perf_counter_ns()
            self.r1 = resource.getrusage(resource.RUSAGE_SELF)

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            self.calls += 1
        elif event == "c_call":
            self.c_calls += 1

    def _gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 0:
            self.gc0 += 1

    def result(self) -> dict[str, Any]:
        n = self.end - self.start
        out: dict[str, Any] = {"steps": self.step, "window": [self.start + 1, self.end]}
        if self.baton is not None:
            out["block_us_per_step"] = [t / 1e3 / self.baton.block for t in self.baton.times]
            out["us_per_step"] = sum(self.baton.times) / 1e3 / n
            out["median_step_us"] = statistics.median(self.baton.steps) / 1e3
            out["turn_spans_ns"] = self.baton.spans
            return out
        if self.mode in ("time", "instructions"):  # (instructions: valgrind's report has them)
            out["us_per_step"] = (self.t1 - self.t0) / 1e3 / n
            r0, r1 = self.r0, self.r1
            out["rusage_per_step"] = {
                "user_us": (r1.ru_utime - r0.ru_utime) * 1e6 / n,
                "system_us": (r1.ru_stime - r0.ru_stime) * 1e6 / n,
                "minor_faults": (r1.ru_minflt - r0.ru_minflt) / n,
                "context_switches": (r1.ru_nvcsw + r1.ru_nivcsw - r0.ru_nvcsw - r0.ru_nivcsw) / n}
        elif self.mode == "calls":
            c = self.call_counts  # c[i]: at the end of step start + i
            per = {k: c[k - self.start] - c[k - 1 - self.start] for k in range(self.start + 1, self.end + 1)}
            plain = [v for k, v in per.items() if k % LOG_EVERY and (k - 1) % LOG_EVERY]
            after_log = [v for k, v in per.items() if (k - 1) % LOG_EVERY == 0]
            out.update(python_calls=self.calls / n, c_calls=self.c_calls / n,
                       gc0_per_1000_steps=1000 * self.gc0 / n,
                       plain_step_python_calls=statistics.median(plain),
                       log_point_python_calls=statistics.median(after_log) - statistics.median(plain))
            if self.kept:  # container objects a plain step leaves alive (median)
                k = self.kept_counts
                out["plain_step_kept_objects"] = statistics.median(
                    k[i - self.start] - k[i - 1 - self.start] for i in range(self.start + 1, self.end + 1)
                    if i % LOG_EVERY and (i - 1) % LOG_EVERY)
        else:  # device: syncs and torch operators
            c, o = self.sync_counts, self.op_counts
            plain = [k for k in range(self.start + 1, self.end + 1)
                     if k % LOG_EVERY and (k - 1) % LOG_EVERY]
            out.update(syncs_per_step=(c[self.end - 1] - c[self.start - 1]) / n,
                       syncs_between_log_points=sum(c[k - 1] - c[k - 2] for k in plain),
                       torch_ops=(o[self.end - 1] - o[self.start - 1]) / n,
                       plain_step_torch_ops=statistics.median(o[k - 1] - o[k - 2] for k in plain))
        return out


class Baton:
    """Turns in a lockstep run: the variants' processes share one core and run `block` steps
    each in turn, passing a token through pipes; each times only its own turns. The machine's
    drift (other tenants, frequency) falls on neighbouring turns alike, so a variant's ratio to
    the hand loop over the same turns resolves what fresh processes one after another cannot."""

    def __init__(self, block: int, mine: int, following: int, ready: int) -> None:
        self.block, self.mine, self.following, self.ready = block, mine, following, ready
        self.times: list[int] = []  # per turn
        self.spans: list[tuple[int, int]] = []  # each turn's start and end (the clock is the machine's)
        self.steps: list[int] = []  # per step of the window
        self.t0 = self.last = 0

    def stamp(self) -> None:
        now = time.perf_counter_ns()
        self.steps.append(now - self.last)
        self.last = now

    def turn(self, first: bool, last: bool) -> None:
        now = time.perf_counter_ns()
        if first:
            os.write(self.ready, b"r")  # at the window's start: wait for every variant
        else:
            self.times.append(now - self.t0)
            self.spans.append((self.t0, now))
            self._pass()
        os.read(self.mine, 1)
        if last:  # one lap more, untimed: no variant ends (and tears down) in another's turn
            self._pass()
        self.t0 = self.last = time.perf_counter_ns()

    def _pass(self) -> None:
        try:
            os.write(self.following, b"t")
        except BrokenPipeError:  # the following variant has ended (after its extra lap)
            pass


class OpCounter:
    """Counts the torch operators dispatched (a TorchDispatchMode; on a GPU each is about one
    kernel launch)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                counter.count += 1
                return func(*args, **(kwargs or {}))

        self.count = 0
        self.mode = Mode()


def hand_loop(steps: int, window: Window, workload: str = "mlp", lean: bool = False) -> float:
    """The reference: the job written by hand, as a careful user writes it. `lean`: its
    clipping and zeroing written out with torch's kernels, as saferun's loop runs them."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader

    from common import build_datasets, build_model

    torch.manual_seed(0)
    model = build_model(workload)
    train_set, _ = build_datasets(workload)
    loader = DataLoader(train_set, batch_size=64, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    params = list(model.parameters())
    loss_sum, last, step = torch.zeros(()), 0.0, 0

    def clip_lean(max_norm: float) -> torch.Tensor:  # clip_grad_norm_'s kernels, in its order
        grads = [p.grad for p in params if p.grad is not None]
        with torch.no_grad():
            norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
            torch._foreach_mul_(grads, torch.clamp((norm + 1e-6).reciprocal() * max_norm, max=1.0))
        return norm

    model.train()
    while step < steps:
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if lean:
                clip_lean(1.0)
                opt.step()
                for p in params:
                    p.grad = None
            else:
                nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
            loss_sum += loss.detach()
            step += 1
            window.tick()
            if step % LOG_EVERY == 0:
                last = loss_sum.item() / LOG_EVERY  # the one host read per log interval
                loss_sum.zero_()
            if step == steps:
                break
    return last


def saferun_loop(steps: int, window: Window, guards: dict[str, Any], run_dir: str,
                 workload: str = "mlp") -> float:
    """The same job as a saferun Trainer, with its defaults (and `guards`)."""
    from typing import Optional as Opt

    import torch
    import torch.nn.functional as F
    from torch.utils.data import Dataset

    import saferun
    from common import build_datasets, build_model

    class Tick(saferun.Callback):
        def on_train_step_end(self, view: Any, output: Any) -> None:
            window.tick()

    class Job(saferun.Trainer):
        def build_model(self) -> torch.nn.Module:
            return build_model(workload)

        def build_datasets(self) -> tuple[Dataset, Opt[Dataset]]:
            return build_datasets(workload)[0], None

        def training_step(self, batch: Any) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.model(x), y)

    cfg = {"trainer": {"max_steps": steps, "batch_size": 64, "log_every_n_steps": LOG_EVERY,
                       "max_grad_norm": 1.0, "device": "cpu", "run_dir": run_dir},
           "optim": {"_target_": "torch.optim.AdamW", "lr": 1e-3}, "seed": 0,
           **({"guards": guards} if guards else {})}
    return Job(cfg, callbacks=[Tick()]).fit()["train/loss"]


def child(variant: str, mode: str, steps: int, start: int, workload: str = "mlp",
          baton: Optional[Baton] = None) -> dict[str, Any]:
    """One run of `variant` in this process."""
    sys.path.insert(0, HERE)
    import torch

    torch.set_num_threads(1)
    window = Window(start, steps, mode)
    window.baton = baton
    counter = None
    if mode == "device":
        from saferun.guards.syncs import HostSyncCounter
        counter = window.syncs = HostSyncCounter()
        window.ops = OpCounter()
        counter.__enter__()
        window.ops.mode.__enter__()
    loop = variant.split("@")[0]  # (saferun@baseline: the baseline's saferun, on PYTHONPATH)
    with tempfile.TemporaryDirectory() as run_dir:
        if loop in ("hand", "lean"):
            loss = hand_loop(steps, window, workload, lean=loop == "lean")
        else:
            loss = saferun_loop(steps, window, STRICT if loop == "strict" else {}, run_dir,
                                workload)
    if counter is not None:
        window.ops.mode.__exit__(None, None, None)
        counter.__exit__(None, None, None)
    out = {"variant": variant, "mode": mode, "final_loss": loss, **window.result()}
    if loop not in ("hand", "lean"):  # which saferun ran (a baseline's: its checkout's)
        out["saferun"] = os.path.dirname(os.path.dirname(sys.modules["saferun"].__file__ or ""))
    return out


def spawn(variant: str, mode: str, steps: int, start: int, workload: str = "mlp") -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--mode", mode,
           "--steps", str(steps), "--start", str(start), "--workload", workload]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=HERE)
    if proc.returncode != 0:
        sys.exit(f"{variant} ({mode}) failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def instructions(steps: int, start: int, workload: str = "mlp",
                 variants: tuple[str, ...] = VARIANTS) -> dict[str, Any]:
    """Instructions per step of the window, per variant: each run once under callgrind (the
    count does not vary from run to run beyond a few hundredths of a percent); the ratio to
    the hand loop where it ran too."""
    out: dict[str, Any] = {}
    for v in variants:
        with tempfile.TemporaryDirectory() as d:
            log = os.path.join(d, "callgrind.log")
            cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--log-file={log}",
                   f"--callgrind-out-file={os.path.join(d, 'callgrind.out')}", sys.executable,
                   os.path.abspath(__file__), "--child", v, "--mode", "instructions",
                   "--steps", str(steps), "--start", str(start), "--workload", workload]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=HERE)
            with open(log) as f:
                report = f.read()
        found = re.search(r"Collected : (\d+)", report)
        if proc.returncode != 0 or found is None:
            sys.exit(f"{v} under callgrind failed:\n{proc.stdout}\n{proc.stderr}\n{report}")
        out[v] = {"instructions_per_step": int(found.group(1)) / (steps - start)}
    for v in variants if "hand" in out else ():
        out[v]["ratio"] = out[v]["instructions_per_step"] / out["hand"]["instructions_per_step"]
    return out


def timed(rounds: int, steps: int, start: int, say: Callable[[str], None],
          workload: str = "mlp") -> dict[str, Any]:
    """`rounds` rounds of every variant, the order rotating; ratios to the round's hand loop."""
    runs: list[dict[str, Any]] = []
    for r in range(rounds):
        order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
        got = {v: spawn(v, "time", steps, start, workload) for v in order}
        for v in VARIANTS:
            got[v].update(round=r, ratio=got[v]["us_per_step"] / got["hand"]["us_per_step"])
            runs.append(got[v])
        say(f"round {r + 1}/{rounds}: " + ", ".join(
            f"{v} {got[v]['us_per_step']:.1f} us ({got[v]['ratio']:.3f}x)" for v in VARIANTS))
    return {"rounds": rounds, "runs": runs, "summary": summarize(runs)}


def summarize(runs: list[dict[str, Any]], variants: tuple[str, ...] = VARIANTS) -> dict[str, Any]:
    """Per variant: the median over rounds of its time, its ratio to the round's hand loop and
    the microseconds per step it adds."""
    summary = {}
    for v in variants:
        mine = [x for x in runs if x["variant"] == v]
        hand = [x["us_per_step"] for x in runs if x["variant"] == "hand"]
        summary[v] = {"median_us_per_step": statistics.median(x["us_per_step"] for x in mine),
                      "median_ratio": statistics.median(x["ratio"] for x in mine),
                      "ratio_range": [min(x["ratio"] for x in mine), max(x["ratio"] for x in mine)],
                      "median_added_us": statistics.median(
                          x["us_per_step"] - h for x, h in zip(mine, hand))}
        if "median_step_ratio" in mine[0]:  # lockstep: the typical step alone (no log point)
            summary[v]["median_step_ratio"] = statistics.median(x["median_step_ratio"] for x in mine)
    return summary


def lockstep(rounds: int, steps: int, start: int, block: int, say: Callable[[str], None],
             workload: str = "mlp", cpu: Optional[int] = None,
             baseline: Optional[str] = None,
             variants: tuple[str, ...] = VARIANTS) -> dict[str, Any]:
    """`rounds` rounds; in each, the variants run at once on one core, taking turns of `block`
    steps through the window (the order rotating from round to round). A round's ratio is a
    variant's time over all its turns to the hand loop's over the same turns. `baseline`:
    another checkout's root; its saferun runs the two saferun variants too, in the same turns
    (`saferun@baseline`, `strict@baseline`)."""
    cpu = max(os.sched_getaffinity(0)) if cpu is None else cpu
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    variants += ("saferun@baseline", "strict@baseline") if baseline else ()
    runs: list[dict[str, Any]] = []
    for r in range(rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        tokens = {v: os.pipe() for v in order}
        ready_r, ready_w = os.pipe()
        procs = {}
        for i, v in enumerate(order):
            mine, following = tokens[v][0], tokens[order[(i + 1) % len(order)]][1]
            cmd = [sys.executable, os.path.abspath(__file__), "--child", v, "--mode", "lockstep",
                   "--steps", str(steps), "--start", str(start), "--workload", workload,
                   "--baton", f"{block},{mine},{following},{ready_w}"]
            procs[v] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        env={**env, "PYTHONPATH": baseline or ""} if "@" in v else env,
                                        cwd=HERE, pass_fds=(mine, following, ready_w),
                                        preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
        os.close(ready_w)  # (the children hold their ends of every pipe)
        for v in order:
            os.close(tokens[v][0])
            if v != order[0]:
                os.close(tokens[v][1])
        waiting = len(order)
        while waiting:  # every variant at the window's start (or gone: its error follows)
            seen = os.read(ready_r, waiting)
            waiting = 0 if not seen else waiting - len(seen)
        os.close(ready_r)
        try:
            os.write(tokens[order[0]][1], b"t")  # the first turn
        except BrokenPipeError:
            pass
        os.close(tokens[order[0]][1])
        got = {}
        for v, proc in procs.items():
            out, err = proc.communicate()
            if proc.returncode != 0:
                sys.exit(f"{v} (lockstep) failed:\n{out}\n{err}")
            got[v] = json.loads(out.strip().splitlines()[-1])
        hand_blocks = got["hand"]["block_us_per_step"]
        for v in variants:
            got[v].update(round=r, ratio=got[v]["us_per_step"] / got["hand"]["us_per_step"],
                          median_step_ratio=got[v]["median_step_us"] / got["hand"]["median_step_us"],
                          block_ratios=[b / h for b, h in zip(got[v]["block_us_per_step"], hand_blocks)])
            runs.append(got[v])
        say(f"round {r + 1}/{rounds}: " + ", ".join(
            f"{v} {got[v]['us_per_step']:.1f} us ({got[v]['ratio']:.3f}x; median step "
            f"{got[v]['median_step_us']:.1f} us, {got[v]['median_step_ratio']:.3f}x)" for v in variants))
    return {"rounds": rounds, "block": block, "cpu": cpu, "baseline": baseline, "runs": runs,
            "summary": summarize(runs, variants)}


def counted(steps: int, start: int, workload: str = "mlp") -> dict[str, Any]:
    out = {}
    for v in VARIANTS:
        calls = spawn(v, "calls", steps, start, workload)
        device = spawn(v, "device", steps, start, workload)
        out[v] = {k: calls[k] for k in ("python_calls", "plain_step_python_calls",
                                         "log_point_python_calls", "c_calls", "gc0_per_1000_steps")}
        out[v].update({k: device[k] for k in ("torch_ops", "plain_step_torch_ops",
                                              "syncs_per_step", "syncs_between_log_points")})
        out[v]["final_loss"] = calls["final_loss"]
    return out


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=9, help="rounds of the three variants")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--start", type=int, default=200, help="the window starts after this step")
    p.add_argument("--count", action="store_true", help="counts per step instead of times")
    p.add_argument("--instructions", action="store_true",
                   help="instructions per step under valgrind (window: steps 201-400 unless "
                        "--steps says otherwise)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="with --instructions or --lockstep: which of hand,saferun,strict to run "
                        "(comma-separated; --lockstep needs hand and also takes lean)")
    p.add_argument("--workload", default="mlp", choices=("mlp", "cnn"),
                   help="the job's model and data (benchmarks/common.py); the same loop")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 150 steps (window 51-150), one round, and the counts")
    p.add_argument("--lockstep", type=int, metavar="BLOCK", default=0,
                   help="time the variants at once on one core, in turns of BLOCK steps "
                        "(a multiple of 100 keeps one log point per turn)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--baseline", metavar="DIR",
                   help="with --lockstep: also run the saferun variants with the saferun of the "
                        "checkout at DIR (e.g. a git worktree of an earlier commit), in the same turns")
    p.add_argument("--child", choices=VARIANTS + EXTRA + ("saferun@baseline", "strict@baseline"),
                   help=argparse.SUPPRESS)
    p.add_argument("--mode", default="time",
                   choices=("time", "calls", "device", "instructions", "lockstep"),
                   help=argparse.SUPPRESS)
    p.add_argument("--baton", help=argparse.SUPPRESS)  # a lockstep child's block and pipes
    a = p.parse_args(argv)
    if a.child:
        baton = Baton(*map(int, a.baton.split(","))) if a.baton else None
        print(json.dumps(child(a.child, a.mode, a.steps, a.start, a.workload, baton)))
        return {}
    if a.quick:
        a.rounds, a.steps, a.start = 1, 150, 50
    if a.instructions and "--steps" not in (argv if argv is not None else sys.argv):
        a.steps = 400  # (about 35 s per variant of the window under callgrind, on the MLP)
    if (a.steps - a.start < LOG_EVERY and not a.instructions) or a.start < 2:
        p.error(f"the window (steps {a.start + 1}-{a.steps}) must hold a log interval "
                f"({LOG_EVERY} steps) and start after step 1")
    results: dict[str, Any] = {"workload": a.workload, "steps": a.steps,
                               "window": [a.start + 1, a.steps], "threads": 1,
                               "python": sys.version.split()[0]}
    variants = tuple(v for v in a.variants.split(",") if v)
    if not variants or set(variants) - set(VARIANTS + (EXTRA if a.lockstep else ())) or (
            a.lockstep and "hand" not in variants):
        p.error(f"--variants takes some of {','.join(VARIANTS)} (--lockstep: with hand, and "
                f"also lean); got {a.variants!r}")
    if a.instructions:
        results["instructions"] = counts = instructions(a.steps, a.start, a.workload, variants)
        print(f"instructions per step, steps {a.start + 1}-{a.steps}:")
        for v, c in counts.items():
            n = c["instructions_per_step"]
            to_hand = (f"  ({c['ratio']:.4f}x, {n - counts['hand']['instructions_per_step']:+,.0f})"
                       if "hand" in counts else "")
            print(f"  {v:8s} {n:12,.0f}{to_hand}")
    elif a.count or a.quick:
        results["per_step"] = counted(a.steps, a.start, a.workload)
        print(f"per step, steps {a.start + 1}-{a.steps}:")
        for v, c in results["per_step"].items():
            print(f"  {v:8s} python calls {c['python_calls']:7.1f} (a plain step "
                  f"{c['plain_step_python_calls']:.0f}, a log point +{c['log_point_python_calls']:.0f})"
                  f"  C calls {c['c_calls']:6.1f}  torch ops {c['torch_ops']:6.1f} (a plain step "
                  f"{c['plain_step_torch_ops']:.0f})  gc0/1000 steps {c['gc0_per_1000_steps']:5.1f}"
                  f"  syncs/step {c['syncs_per_step']:.3f}, between log points "
                  f"{c['syncs_between_log_points']}")
    if a.lockstep and (a.steps - a.start) % a.lockstep:
        p.error(f"--lockstep {a.lockstep}: the window's {a.steps - a.start} steps must be whole turns")
    if not a.count and not a.instructions:
        if a.baseline and not (a.lockstep and os.path.isdir(os.path.join(a.baseline, "saferun"))):
            p.error("--baseline DIR needs --lockstep and a checkout of saferun at DIR")
        results["timed"] = (lockstep(a.rounds, a.steps, a.start, a.lockstep, print, a.workload,
                                     baseline=a.baseline and os.path.abspath(a.baseline),
                                     variants=variants)
                            if a.lockstep else timed(a.rounds, a.steps, a.start, print, a.workload))
        for v, s in results["timed"]["summary"].items():
            print(f"  {v:8s} {s['median_us_per_step']:8.1f} us/step  median ratio "
                  f"{s['median_ratio']:.3f}x ({s['ratio_range'][0]:.3f}-{s['ratio_range'][1]:.3f})"
                  f"  adds {s['median_added_us']:+.1f} us/step"
                  + (f"; the median step {s['median_step_ratio']:.3f}x" if "median_step_ratio" in s else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
