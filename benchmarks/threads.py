"""trainer.num_threads=auto against forced thread counts: the README's first command, timed.

    python benchmarks/threads.py                         # digits and charlm, 5 rounds
    python benchmarks/threads.py --workloads digits --rounds 1 --steps 20   # a smoke run

Each run is `python -m saferun run` (the README's `saferun run`: the digits recipe; and
`recipe=charlm`, a model large enough for two threads to help) in a fresh process, with one
thread setting per arm:

- `auto`: the environment as a user has it (no OMP_NUM_THREADS): saferun's default plan;
- `1`, `2`: trainer.num_threads=1 or 2;
- `torch`: trainer.num_threads set to what torch chooses by itself here (one per core).

Every arm runs twice per round: on the quiet machine, and beside one busy process (a Python
loop burning one core, started before the run and stopped after it). Within a round the arms
run in an order that rotates from round to round, so drift of the machine falls on all of
them. The figure is the median wall time of each arm over the rounds (the whole command:
start-up, data, training, validation, saves), and per workload and condition the ratio of
`auto` to the best of the forced arms. The goal (issue 35): `auto` within 1.05x of that best.

Timings are only worth something on a machine nobody else uses; the script prints the load
average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOADS = {"digits": [], "charlm": ["recipe=charlm"]}  # the README's `saferun run`, and charlm
ARMS = ("auto", "1", "2", "torch")
CONDITIONS = ("quiet", "busy")
GOAL = 1.05


def torch_default_threads() -> int:
    """The intra-op threads torch takes by itself in a fresh process (no OMP_NUM_THREADS)."""
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                         env=clean_env(), capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def clean_env() -> dict[str, str]:
    """This environment without the variables that set threads: each arm chooses its own."""
    return {k: v for k, v in os.environ.items()
            if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY")}


class Busy:
    """One process burning a core for as long as the `with` block lasts."""

    def __enter__(self) -> "Busy":
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        return self

    def __exit__(self, *exc: Any) -> None:
        self.proc.kill()
        self.proc.wait()


def one_run(workload: str, arm: str, torch_threads: int, steps: Optional[int], run_dir: str
            ) -> dict[str, Any]:
    """One fresh `python -m saferun run` of `workload` with `arm`'s threads: wall seconds."""
    args = [*WORKLOADS[workload], f"hydra.run.dir={run_dir}", "trainer.progress_bar=false"]
    if arm != "auto":
        args.append(f"trainer.num_threads={torch_threads if arm == 'torch' else arm}")
    if steps is not None:
        args += [f"trainer.max_steps={steps}", f"trainer.log_every_n_steps={max(1, steps // 2)}",
                 f"trainer.val_every_n_steps={steps}"]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "saferun", "run", *args], cwd=REPO,
                          env=clean_env(), capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{workload} ({arm}) failed:\n{proc.stdout}\n{proc.stderr}")
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "threads:" in line]
    summary = json.loads(open(os.path.join(run_dir, "summary.json")).read())
    return {"seconds": seconds, "plan": said[0].split("threads:", 1)[1].strip() if said else "",
            "val_loss": summary["metrics"].get("val/loss")}


def measure(workloads: list[str], rounds: int, steps: Optional[int]) -> dict[str, Any]:
    torch_threads = torch_default_threads()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="saferun-threads-") as tmp:
        for r in range(rounds):
            order = ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)]
            for workload in workloads:
                for condition in CONDITIONS:
                    for arm in order:
                        run_dir = os.path.join(tmp, f"{workload}-{condition}-{arm}-{r}")
                        if condition == "busy":
                            with Busy():
                                got = one_run(workload, arm, torch_threads, steps, run_dir)
                        else:
                            got = one_run(workload, arm, torch_threads, steps, run_dir)
                        runs.append({"round": r, "workload": workload, "condition": condition,
                                     "arm": arm, **got})
                        print(f"round {r + 1}/{rounds} {workload:7s} {condition:5s} {arm:5s} "
                              f"{got['seconds']:7.2f} s  ({got['plan']})", flush=True)
    table = {}
    for workload in workloads:
        for condition in CONDITIONS:
            median = {arm: statistics.median(x["seconds"] for x in runs if (
                x["workload"], x["condition"], x["arm"]) == (workload, condition, arm))
                for arm in ARMS}
            best = min(median[arm] for arm in ARMS if arm != "auto")
            table[f"{workload} {condition}"] = {"median_seconds": median,
                                                "auto_over_best": median["auto"] / best}
    return {"rounds": rounds, "steps": steps, "torch_default_threads": torch_threads,
            "cpus": len(os.sched_getaffinity(0)), "runs": runs, "table": table}


def render(result: dict[str, Any]) -> str:
    lines = [f"median wall seconds over {result['rounds']} rounds (torch's own choice here: "
             f"{result['torch_default_threads']} threads, {result['cpus']} usable CPUs)",
             f"  {'workload':16s} " + " ".join(f"{a:>8s}" for a in ARMS) + "  auto / best forced"]
    for name, row in result["table"].items():
        ratio = row["auto_over_best"]
        lines.append(f"  {name:16s} " + " ".join(f"{row['median_seconds'][a]:8.2f}" for a in ARMS)
                     + f"  {ratio:.3f}x ({'within' if ratio <= GOAL else 'NOT within'} {GOAL}x)")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="digits,charlm",
                   help=f"comma-separated, of {', '.join(WORKLOADS)}")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, help="trainer.max_steps (default: the recipe's)")
    p.add_argument("--json", help="write the runs and the table here")
    a = p.parse_args(argv)
    workloads = a.workloads.split(",")
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        p.error(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")
    before = os.getloadavg()
    result = measure(workloads, a.rounds, a.steps)
    result["loadavg"] = [before[0], os.getloadavg()[0]]
    print(render(result))
    print(f"load average {before[0]:.2f} before, {result['loadavg'][1]:.2f} after")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
