"""saferun's `Trainer.train_step` against the hand-written step, alternated in one process.

    python benchmarks/step_micro.py                      # MLP, 3000 pairs
    python benchmarks/step_micro.py --workload cnn --pairs 1000 --json out.json
    python benchmarks/step_micro.py --guards --pairs 2000   # each optional guard's cost

A whole-process benchmark (`run.py`) swings by tens of percent on a shared machine, so it
cannot show a 2 % change. This one can: both steps live in one process and train the same
model with the same AdamW (saferun's, built by the Trainer), on pre-built batches held in
memory (no DataLoader), so that the only difference between them is the code that runs. The
two steps take turns, one pair at a time, both on the same batch, and the order inside a pair
alternates (saferun first, then hand first), so machine drift and any "second in the pair"
effect fall on both alike (`--block K` lets each run K steps in a row instead, closer to a
real loop, where a step follows a step of its own kind). Each step is timed with
`time.perf_counter_ns` (wall) and `time.thread_time_ns` (this thread's CPU time, which leaves
out the time spent waiting for a core on a busy machine). The headline is the median of the
per-pair ratios saferun / hand, then the median paired difference in microseconds, each
order-balanced and with a bootstrap 95 % interval; the ratio of the two median step times is
shown too (the least robust of the three: see docs/benchmarks.md).

saferun runs with the benchmark job's config (`loop_saferun.config`: every default guard on).
The hand step is `loop_hand.py`'s step without its running sums (which are logging, like
saferun's `fit` bookkeeping outside `train_step`): move the batch, forward, cross-entropy,
backward, `clip_grad_norm_(1.0)`, AdamW step, `zero_grad(set_to_none=True)`, loss kept on the
device. That they compute the same thing is checked during the warm-up: there the hand step
trains a copy of the model (same initial weights) with its own AdamW, and afterwards both
models (parameters and buffers) and both optimizer states must be bitwise equal. (Timing two
copies instead of one shared model would add a difference of memory placement between them,
which can be worth a percent.)

`--control` puts a second hand step in saferun's place: an A/A run that shows what the method
reports when there is no difference.

It also counts, per step, the Python function calls and C calls (`sys.setprofile`), the
torch operators dispatched (a `TorchDispatchMode`) and the host syncs (saferun's own
`HostSyncCounter`). Those runs are separate from the timed ones.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from common import Job, build_datasets, build_model
from loop_saferun import BenchTrainer, config

HERE = os.path.dirname(os.path.abspath(__file__))
Step = Callable[[Any], Any]


def hand_step(model: nn.Module, opt: torch.optim.Optimizer, device: torch.device,
              max_grad_norm: float) -> Step:
    """loop_hand.py's step, line for line, without the running sums (CPU: fp32, no autocast)."""
    autocast = contextlib.nullcontext

    def step(micro_batches: Sequence[Any]) -> torch.Tensor:
        x, y = micro_batches[0]  # one batch per step, as saferun's train_step gets it
        x, y = x.to(device, non_blocking=False), y.to(device, non_blocking=False)
        with autocast():
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def build(workload: str, run_dir: str, n_batches: int, guards: dict[str, Any] | None = None,
          ema: float | None = None) -> tuple[BenchTrainer, Step, nn.Module, torch.optim.Optimizer, list]:
    """saferun's trainer (set up, not fitted), the hand step on a copy of its model (same
    weights, own AdamW), that copy, its optimizer, and the batches.

    `guards` overrides keys of the guards config (default: none, every default guard on);
    `ema`: saferun's trainer keeps a weight average with this decay (trainer.ema).
    """
    job = Job(workload=workload, device="cpu", steps=10**9, log_every=50, val_every=500,
              warmup=0, run_dir=run_dir)
    cfg = config(job)
    cfg["trainer"]["ema"] = {"decay": ema}
    trainer = BenchTrainer({**cfg, "guards": guards or {}})
    trainer.workload = workload
    trainer.setup()  # seeds, builds the model, data and AdamW; no step taken
    model = build_model(workload)
    model.load_state_dict(trainer.model.state_dict())  # the same initial weights and buffers
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=job.lr)
    train_set, _ = build_datasets(workload)
    x, y = train_set.tensors
    b = job.batch_size
    n = min(n_batches, len(x) // b)
    # Independent contiguous tensors, like a DataLoader's collated batches; one list per step.
    groups = [[(x[i * b:(i + 1) * b].clone(), y[i * b:(i + 1) * b].clone())] for i in range(n)]
    step = hand_step(model, opt, trainer.device, job.max_grad_norm)
    return trainer, step, model, opt, groups


def alternate(saferun: Step, hand: Step, groups: list, pairs: int, block: int = 1
              ) -> dict[str, np.ndarray]:
    """Run `pairs` pairs of steps; pair i is both steps on batch i.

    The steps take turns in blocks of `block` steps (1: ABAB...), saferun first in even blocks
    and hand first in odd ones. Returns each step's wall time (`perf_counter_ns`) and this
    thread's CPU time (`thread_time_ns`, which leaves out the time the thread waited for a
    core) in ns, and `saferun_first`, which pairs had saferun's block first.
    """
    times = {k: np.empty(pairs, dtype=np.int64)
             for k in ("saferun_wall", "saferun_cpu", "hand_wall", "hand_cpu")}
    a = (saferun, times["saferun_wall"], times["saferun_cpu"])
    b = (hand, times["hand_wall"], times["hand_cpu"])
    wall, cpu = time.perf_counter_ns, time.thread_time_ns
    n = len(groups)
    for start in range(0, pairs, block):
        pair_range = range(start, min(start + block, pairs))
        for step, wall_ns, cpu_ns in ((b, a) if (start // block) & 1 else (a, b)):
            for i in pair_range:
                group = groups[i % n]
                w0, c0 = wall(), cpu()
                step(group)
                c1, w1 = cpu(), wall()
                wall_ns[i], cpu_ns[i] = w1 - w0, c1 - c0
    times["saferun_first"] = (np.arange(pairs) // block) % 2 == 0
    return times


def summarize(ts: np.ndarray, th: np.ndarray, saferun_first: np.ndarray, resamples: int = 2000,
              blocks: int = 5) -> dict[str, Any]:
    """Paired differences and ratios with bootstrap 95 % intervals (times in us).

    The estimates are order-balanced: the median over the pairs where saferun ran first and
    the median over those where it ran second, averaged, so that an effect of running first
    or second cancels exactly (a crossover design). The per-pair ratio is the headline: when
    other processes slow the machine down, both steps of a pair slow down alike, which moves
    their difference but not their ratio.
    """
    s, h = ts / 1e3, th / 1e3
    d, r = s - h, s / h
    halves = (np.flatnonzero(saferun_first), np.flatnonzero(~saferun_first))

    def balanced(x: np.ndarray) -> float:
        return float(np.median(x[halves[0]]) + np.median(x[halves[1]])) / 2

    rng = np.random.default_rng(0)
    boot: dict[str, list[np.ndarray]] = {"d": [], "r": [], "m": []}
    for _ in range(0, resamples, 100):  # in chunks: 100 resamples of all pairs at a time
        # Resample within each order, so that every resample keeps the balance.
        idx = tuple(rng.choice(half, size=(100, len(half))) for half in halves)
        both = np.concatenate(idx, axis=1)
        boot["d"].append((np.median(d[idx[0]], axis=1) + np.median(d[idx[1]], axis=1)) / 2)
        boot["r"].append((np.median(r[idx[0]], axis=1) + np.median(r[idx[1]], axis=1)) / 2)
        boot["m"].append(np.median(s[both], axis=1) / np.median(h[both], axis=1))

    def ci(key: str) -> list[float]:
        values = np.concatenate(boot[key])
        return [float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5))]

    return {
        "pairs": len(d),
        "hand_median_us": float(np.median(h)),
        "saferun_median_us": float(np.median(s)),
        "pair_ratio": balanced(r),
        "pair_ratio_ci95": ci("r"),
        "diff_us": balanced(d),
        "diff_ci95_us": ci("d"),
        "diff_iqr_us": [float(np.percentile(d, 25)), float(np.percentile(d, 75))],
        "ratio_of_medians": float(np.median(s) / np.median(h)),
        "ratio_of_medians_ci95": ci("m"),
        # Checks on the design: order within a pair, and drift across the run.
        "diff_median_saferun_first_us": float(np.median(d[halves[0]])),
        "diff_median_saferun_second_us": float(np.median(d[halves[1]])),
        "diff_median_by_block_us": [float(np.median(part)) for part in np.array_split(d, blocks)],
    }


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += 1
        return func(*args, **(kwargs or {}))


def counts(step: Step, groups: list, n: int) -> dict[str, float]:
    """Per step: Python calls, C calls, torch ops dispatched, host syncs (untimed runs)."""
    from saferun.guards.syncs import HostSyncCounter  # the counter saferun's own tests use

    events: collections.Counter[str] = collections.Counter()

    def profile(frame: Any, event: str, arg: Any) -> None:
        events[event] += 1

    sys.setprofile(profile)
    try:
        for i in range(n):
            step(groups[i % len(groups)])
    finally:
        sys.setprofile(None)
    ops = _OpCounter()
    with ops:
        for i in range(n):
            step(groups[i % len(groups)])
    with HostSyncCounter() as syncs:
        for i in range(n):
            step(groups[i % len(groups)])
    return {"python_calls": events["call"] / n, "c_calls": events["c_call"] / n,
            "torch_ops": ops.count / n, "host_syncs": syncs.count / n}


def check_same_state(trainer: BenchTrainer, model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Raise unless both models and both optimizers are bitwise equal; return tensors compared."""
    a, b = trainer.model.state_dict(), model.state_dict()
    assert a.keys() == b.keys(), (a.keys(), b.keys())
    compared = 0
    for k in a:
        if not torch.equal(a[k], b[k]):
            raise SystemExit(f"not the same arithmetic: model tensor {k} differs "
                             f"(max abs diff {(a[k].double() - b[k].double()).abs().max()}).")
        compared += 1
    sa, sb = trainer.optimizer.state_dict()["state"], opt.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for k in sa[i]:
            if not torch.equal(sa[i][k], sb[i][k]):
                raise SystemExit(f"not the same arithmetic: optimizer state {i}.{k} differs.")
            compared += 1
    return compared


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=("mlp", "cnn"), default="mlp")
    p.add_argument("--pairs", type=int, default=3000, help="timed pairs (default 3000)")
    p.add_argument("--warmup", type=int, default=200,
                   help="untimed pairs first, on two copies checked for equality (default 200)")
    p.add_argument("--count-steps", type=int, default=50,
                   help="steps of each variant for the call, op and sync counts (default 50)")
    p.add_argument("--batches", type=int, default=64, help="distinct batches cycled through")
    p.add_argument("--block", type=int, default=1,
                   help="steps of one variant before the other takes over (default 1: ABAB)")
    p.add_argument("--control", action="store_true",
                   help="A/A check of the method: a second hand step in saferun's place "
                        "(expect a ratio of 1)")
    p.add_argument("--ema", type=float, default=None, metavar="DECAY",
                   help="time trainer.ema's update alone: the hand step plus the weight average's "
                        "update (as saferun's optimizer hook runs it) against the hand step")
    p.add_argument("--guards", action="store_true",
                   help="instead: each optional guard against the defaults, saferun against "
                        "saferun (benchmarks/guard_costs.py); --pairs rounds of every arm")
    p.add_argument("--json", help="also write the figures here as JSON")
    args = p.parse_args()

    torch.set_num_threads(1)
    if args.guards:
        import guard_costs

        result = guard_costs.run(args.workload, args.pairs, args.warmup, args.batches)
        print(guard_costs.render(result))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="saferun-micro-") as tmp:
        trainer, hand, model, opt, groups = build(args.workload, tmp, args.batches, ema=args.ema)
        max_norm = trainer.cfg.trainer.max_grad_norm

        def saferun_model_hand_step() -> Step:
            return hand_step(trainer.model, trainer.optimizer, trainer.device, max_norm)

        # Warm-up on two copies, then the check that both steps did the same arithmetic.
        first = saferun_model_hand_step() if args.control else trainer.train_step
        alternate(first, hand, groups, args.warmup)
        compared = check_same_state(trainer, model, opt)
        # Timed: one model and optimizer for both steps.
        hand = saferun_model_hand_step()
        saferun = saferun_model_hand_step() if args.control else trainer.train_step
        if args.ema is not None:  # the same step with and without trainer.ema's update
            trainer._ema.hook.remove()
            ema_update, plain = trainer._ema._update, saferun_model_hand_step()

            def saferun(micro_batches: Sequence[Any]) -> Any:  # noqa: F811
                loss = plain(micro_batches)
                ema_update()  # what the optimizer's post-step hook runs in saferun's step
                return loss
        gc.collect()
        started = time.perf_counter()
        times = alternate(saferun, hand, groups, args.pairs, args.block)
        seconds = time.perf_counter() - started
        per_step = {"saferun": counts(saferun, groups, args.count_steps),
                    "hand": counts(hand, groups, args.count_steps)}
    result = {
        "workload": args.workload, "control": args.control, "block": args.block, "ema": args.ema,
        "warmup_pairs": args.warmup, "timed_seconds": seconds,
        "wall": summarize(times["saferun_wall"], times["hand_wall"], times["saferun_first"]),
        "cpu": summarize(times["saferun_cpu"], times["hand_cpu"], times["saferun_first"]),
        "per_step": per_step, "bitwise_equal_tensors": compared,
        "checked_steps": args.warmup,
        "torch": torch.__version__, "threads": torch.get_num_threads(), "commit": git_commit(),
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
    }
    print(render(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def render(r: dict[str, Any]) -> str:
    a = "hand (control)" if r["control"] else "hand+ema" if r.get("ema") else "saferun"
    lines = [
        f"{r['workload']}: {r['wall']['pairs']} pairs, alternating in blocks of {r['block']}, "
        f"after {r['warmup_pairs']} warm-up pairs ({r['timed_seconds']:.1f} s; torch "
        f"{r['torch']}, {r['threads']} thread, commit {r['commit']}; load average "
        f"{r['loadavg_before'][0]:.2f} -> {r['loadavg_after'][0]:.2f})"]
    for clock in ("wall", "cpu"):
        lines += render_clock(r[clock], a, "wall time" if clock == "wall" else "thread CPU time")
    s, h = r["per_step"]["saferun"], r["per_step"]["hand"]
    lines.append(f"  per step        {a:>10} {'hand':>10} {'extra':>8}")
    for key in ("python_calls", "c_calls", "torch_ops", "host_syncs"):
        lines.append(f"  {key:<15} {s[key]:>10.1f} {h[key]:>10.1f} {s[key] - h[key]:>+8.1f}")
    lines.append(f"  same arithmetic: {r['bitwise_equal_tensors']} tensors (parameters, buffers, "
                 f"AdamW state) bitwise equal after {r['checked_steps']} warm-up steps of each "
                 f"on two copies")
    return "\n".join(lines)


def render_clock(r: dict[str, Any], a: str, clock: str) -> list[str]:
    def interval(key: str, fmt: str) -> str:
        lo, hi = r[key]
        return f"[{lo:{fmt}}, {hi:{fmt}}]"

    return [
        f"  {clock}: median step hand {r['hand_median_us']:.1f} us, {a} "
        f"{r['saferun_median_us']:.1f} us",
        f"    {a} / hand, median per-pair ratio: {r['pair_ratio']:.4f}x, "
        f"95% CI {interval('pair_ratio_ci95', '.4f')}",
        f"    {a} - hand, median paired difference: {r['diff_us']:+.1f} us per step, "
        f"95% CI {interval('diff_ci95_us', '+.1f')}, IQR of differences "
        f"{interval('diff_iqr_us', '+.1f')}",
        f"    ratio of medians: {r['ratio_of_medians']:.4f}x, "
        f"95% CI {interval('ratio_of_medians_ci95', '.4f')}",
        f"    median difference with {a} first: {r['diff_median_saferun_first_us']:+.1f} us, "
        f"second: {r['diff_median_saferun_second_us']:+.1f} us; by fifth of the run: "
        + ", ".join(f"{v:+.1f}" for v in r["diff_median_by_block_us"]) + " us",
    ]


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", HERE, "status", "--porcelain", "--", "../saferun"],
                               capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"
    return (out.stdout.strip() or "unknown") + (" +changes" if dirty else "")


if __name__ == "__main__":
    main()
