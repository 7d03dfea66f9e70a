"""What each optional guard costs: `python benchmarks/step_micro.py --guards` (in-process A/B).

One trainer per arm, all in one process, each with saferun's defaults plus that arm's guards
(`GUARD_ARMS`), all from the same initial weights. Each round runs every arm once on the same
batch, in a fresh random order, and each arm's thread CPU time is divided by the defaults
arm's in that round. An arm runs what `fit()` runs per step except callbacks and validation:
`train_step`, the running metrics, and at each log point (every 50 steps) the log with the
guards' checks (`Trainer._log`: check_params and the spike and non-finite checks act there).
This reaches into saferun internals (`Trainer._running`, `Trainer._log`), as step_parts.py does.

Two figures per arm: the median of the per-round ratios (robust to the machine's noise, but
blind to work done only at log points, 1 round in 50) and the ratio of the means (which
includes the log points, and the noise). A second defaults trainer is the A/A control: how
much two copies of the same thing differ here (memory placement, order effects).

The sync audit is a diagnostic and audits sampled steps only, so its arm is one audited step
(the defaults step under `HostSyncCounter`); its cost over a run is that step's extra cost
times the fraction of steps audited.

Per arm it also counts, over whole log intervals (the log point included), the torch
operators dispatched per step (a `TorchDispatchMode`: on a GPU each is about one kernel
launch, views aside) and the host syncs per step.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import tempfile
import time
from typing import Any, Callable

import numpy as np
import torch

Step = Callable[[Any], Any]

GUARD_ARMS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "defaults again (A/A control)": {},
    # threshold 12, as loop_window.py: at the default 6 the guard flags this small job's natural
    # gradient-norm outlier near step 1450 and ends the arm (the threshold changes no work)
    "guards.spikes=raise": {"spikes": "raise", "spike_threshold": 12.0},
    "guards.check_params=true": {"check_params": True},
    "guards.anomaly_replay=true": {"anomaly_replay": True},
    "guards=strict": {"spikes": "raise", "spike_threshold": 12.0, "check_params": True,
                      "anomaly_replay": True},
}
AUDITED = "guards.sync_audit=true, an audited step"


def loop_body(trainer: Any) -> Step:
    """What fit() runs per step, without callbacks and validation."""
    every = trainer.cfg.trainer.log_every_n_steps

    def step(group: Any) -> Any:
        out = trainer.train_step(group)
        trainer._running.add(out)
        if trainer.state.step % every == 0:
            trainer._log()
        return out

    return step


def audited(step: Step) -> Step:
    from saferun.guards.syncs import HostSyncCounter

    def run(group: Any) -> Any:
        with HostSyncCounter():
            return step(group)

    return run


def run(workload: str, rounds: int, warmup: int, n_batches: int) -> dict[str, Any]:
    """Time every arm, `rounds` rounds after `warmup` (at least 200: past the spike window)."""
    warmup = max(warmup, 200)
    from step_micro import build  # the builder step_micro's A/B uses

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="saferun-guards-") as tmp, \
            contextlib.redirect_stdout(open(os.devnull, "w")):  # the log lines at log points
        trainers: dict[str, Any] = {}
        groups: Any = None
        for i, (name, guards) in enumerate(GUARD_ARMS.items()):
            trainer, _, _, _, batches = build(workload, os.path.join(tmp, str(i)), n_batches,
                                              guards=guards)
            trainers[name], groups = trainer, groups or batches
        arms = {name: loop_body(t) for name, t in trainers.items()}
        arms[AUDITED] = audited(loop_body(trainers["defaults"]))
        names = list(arms)
        times = {name: np.empty(rounds, dtype=np.int64) for name in names}
        order = random.Random(0)
        clock = time.thread_time_ns
        for r in range(-warmup, rounds):
            group = groups[r % len(groups)]
            for name in order.sample(names, len(names)):
                c0 = clock()
                arms[name](group)
                c1 = clock()
                if r >= 0:
                    times[name][r] = c1 - c0
            if r == -1:  # warmed up (the spike windows full): count, untimed, then time
                counted = count(arms, groups, trainers["defaults"].cfg.trainer.log_every_n_steps)
                gc.collect()
    base = times["defaults"]
    result: dict[str, Any] = {"workload": workload, "rounds": rounds, "warmup_rounds": warmup,
                              "defaults_median_us": float(np.median(base)) / 1e3,
                              "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                              "torch": torch.__version__, "threads": torch.get_num_threads(), "arms": {}}
    rng = np.random.default_rng(0)
    for name in names:
        ratio = times[name] / base
        boot = rng.choice(ratio, size=(1000, len(ratio)))
        means = [times[name][i].sum() / base[i].sum() for i in rng.integers(0, rounds, (300, rounds))]
        result["arms"][name] = {
            "median_ratio": float(np.median(ratio)),
            "median_ratio_ci95": [float(x) for x in np.percentile(np.median(boot, axis=1), [2.5, 97.5])],
            "mean_ratio": float(times[name].sum() / base.sum()),
            "mean_ratio_ci95": [float(x) for x in np.percentile(means, [2.5, 97.5])],
            "median_us": float(np.median(times[name])) / 1e3, **counted[name]}
    return result


def count(arms: dict[str, Step], groups: list, every: int) -> dict[str, dict[str, float]]:
    """Per arm, over one whole log interval (its log point included): Python and C calls,
    torch operators dispatched and host syncs, per step (step_micro's counters)."""
    from step_micro import counts

    return {name: counts(step, groups, every) for name, step in arms.items()}


def render(r: dict[str, Any]) -> str:
    base = r["arms"]["defaults"]
    lines = [f"{r['workload']}: {r['rounds']} rounds after {r['warmup_rounds']} warm-up rounds, "
             f"thread CPU time, defaults step median {r['defaults_median_us']:.1f} us "
             f"(torch {r['torch']}, {r['threads']} thread; load average "
             f"{r['loadavg_before'][0]:.2f} -> {r['loadavg_after'][0]:.2f})",
             f"  {'arm':<42} {'median ratio [95% CI]':<26} {'mean ratio [95% CI]':<26} "
             f"{'ops/step':>9} {'extra':>6} {'syncs/step':>10}"]
    for name, a in r["arms"].items():
        lo, hi = a["median_ratio_ci95"]
        mlo, mhi = a["mean_ratio_ci95"]
        lines.append(f"  {name:<42} {a['median_ratio']:.4f}x [{lo:.4f}, {hi:.4f}]  "
                     f"{a['mean_ratio']:.4f}x [{mlo:.4f}, {mhi:.4f}]  {a['torch_ops']:>9.1f} "
                     f"{a['torch_ops'] - base['torch_ops']:>+6.1f} {a['host_syncs']:>10.2f}")
    return "\n".join(lines)
