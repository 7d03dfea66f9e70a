"""Runs one variant of one job in this process and writes its figures as JSON.

`run.py` starts one fresh process of this script per run, so no variant inherits another's
imports, allocator state or warm caches. Not meant to be run by hand, but it can be:

    python benchmarks/job.py --variant hand --job '{"workload": "mlp", "device": "cpu",
        "steps": 200, "log_every": 50, "val_every": 100, "warmup": 20, "run_dir": "/tmp/r"}'
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import importlib
import json
import os
import resource
from typing import Any

import torch

from common import CudaSyncWarnings, Job, StepClock

VARIANTS = {"hand": "loop_hand", "saferun": "loop_saferun", "lightning": "loop_lightning"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", choices=sorted(VARIANTS), required=True)
    p.add_argument("--job", required=True, help="the Job's fields as a JSON object")
    p.add_argument("--count-syncs", action="store_true",
                   help="after the timed run, run the job again counting host (and CUDA) syncs")
    p.add_argument("--anomaly", action="store_true",
                   help="run the whole job under torch.autograd.detect_anomaly()")
    p.add_argument("--out", help="write the result here (default: stdout)")
    args = p.parse_args()

    torch.set_num_threads(1)
    job = Job(**json.loads(args.job))
    loop = importlib.import_module(VARIANTS[args.variant])
    clock = StepClock(job)
    with torch.autograd.detect_anomaly() if args.anomaly else contextlib.nullcontext():
        metrics = to_floats(loop.train(job, clock))
    result: dict[str, Any] = {
        "variant": args.variant + ("+anomaly" if args.anomaly else ""),
        "job": job.__dict__, "metrics": metrics, "threads": torch.get_num_threads(),
        # ru_maxrss is in KiB on Linux.
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        **clock.timing(),
    }
    if args.count_syncs:
        result.update(counted_run(loop, job))
    text = json.dumps(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text)


def counted_run(loop: Any, job: Job) -> dict[str, Any]:
    """Run `job` again under the sync counters; its timing is not used (counting slows it)."""
    from saferun.guards.syncs import HostSyncCounter  # the counter saferun's own tests use

    job = dataclasses.replace(job, run_dir=os.path.join(job.run_dir, "counted"))
    with contextlib.ExitStack() as stack:
        host_syncs = stack.enter_context(HostSyncCounter())
        cuda_syncs = stack.enter_context(CudaSyncWarnings()) if job.device == "cuda" else None
        clock = StepClock(job, host_syncs, cuda_syncs)
        metrics = loop.train(job, clock)
    metrics = to_floats(metrics)  # after counting: reading the final metrics is not the loop's doing
    out: dict[str, Any] = {"counted_metrics": metrics, "host_syncs": host_syncs.count,
                           "host": clock.syncs_between_log_points(clock.host_counts),
                           "host_sites": top_sites(host_syncs.sites)}
    if cuda_syncs is not None:
        out["cuda_syncs"] = cuda_syncs.count
        out["cuda"] = clock.syncs_between_log_points(clock.cuda_counts)
    return out


def to_floats(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()}


def top_sites(sites: collections.Counter[str], n: int = 8) -> list[tuple[str, int]]:
    """The most frequent sync sites, paths shortened to the package or the repository."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

    def short(site: str) -> str:
        if "site-packages" + os.sep in site:
            return site.split("site-packages" + os.sep, 1)[1]
        if site.startswith(repo):
            return site[len(repo):]
        marker = os.sep + "saferun" + os.sep  # saferun imported from elsewhere (PYTHONPATH)
        return "saferun" + os.sep + site.split(marker, 1)[1] if marker in site else site

    return [(short(s), c) for s, c in sites.most_common(n)]


if __name__ == "__main__":
    main()
