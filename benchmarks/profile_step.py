"""Where a variant's step time goes: cProfile over one training job, in this process.

    python benchmarks/profile_step.py saferun            # the MLP job, top 30 by own time
    python benchmarks/profile_step.py hand --filter saferun/ --top 40

A short warm-up job runs first so that one-time imports and allocations stay out of the
profile. cProfile adds a fixed cost to every Python call, so it overstates Python-heavy code
next to torch's C++ kernels: use it to find candidates, then time them with timeit.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import importlib
import pstats
import re
import tempfile

import torch

from common import Job, StepClock
from job import VARIANTS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variant", choices=sorted(VARIANTS))
    p.add_argument("--workload", default="mlp", choices=("mlp", "cnn"))
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--filter", default="", help="only functions whose file:line(name) contains this")
    args = p.parse_args()

    torch.set_num_threads(1)
    loop = importlib.import_module(VARIANTS[args.variant])
    with tempfile.TemporaryDirectory() as tmp:
        job = Job(workload=args.workload, device="cpu", steps=args.steps, log_every=50,
                  val_every=args.steps // 4, warmup=args.steps // 10, run_dir=tmp)
        warm = dataclasses.replace(job, steps=100, val_every=50, warmup=10)
        loop.train(warm, StepClock(warm))
        profiler = cProfile.Profile()
        profiler.enable()
        loop.train(job, StepClock(job))
        profiler.disable()
    stats = pstats.Stats(profiler).sort_stats("tottime")
    stats.print_stats(re.escape(args.filter), args.top)


if __name__ == "__main__":
    main()
