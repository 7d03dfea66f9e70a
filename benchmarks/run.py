"""Benchmark saferun against a hand-written PyTorch loop and PyTorch Lightning.

    python benchmarks/run.py               # CPU workloads, then CUDA ones if a GPU is present
    python benchmarks/run.py --repeats 7   # more repetitions: tighter medians
    python benchmarks/run.py --smoke       # a few steps of each variant: does it run?

Every run is a fresh process (benchmarks/job.py). Runs are interleaved (hand, saferun,
lightning, hand+anomaly, hand, saferun, ...) so that a machine whose speed drifts slows all
variants alike, and figures are medians over repetitions. The first process of each variant
then runs the job once more under saferun's HostSyncCounter (and, on CUDA,
torch.cuda.set_sync_debug_mode("warn")) to count syncs; that second run is never timed.

The report goes to stdout and, with the raw figures, to --report-dir (results.md, results.json,
one log per process under logs/). docs/benchmarks.md explains the method and the results.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

# steps, log interval (saferun's default, 50), validation interval, and steps left out of timing.
SCHEDULES = {
    "mlp": {"steps": 2000, "log_every": 50, "val_every": 500, "warmup": 200},
    "cnn": {"steps": 300, "log_every": 50, "val_every": 100, "warmup": 30},
    # the charlm recipe's model and batch size: a small Transformer, where kernels dominate
    "charlm": {"steps": 300, "log_every": 50, "val_every": 100, "warmup": 30, "batch_size": 32},
}
SMOKE = {"steps": 20, "log_every": 5, "val_every": 10, "warmup": 5}
VARIANTS = ("hand", "saferun", "lightning", "hand+anomaly")
# saferun with optional guards on (not run unless named in --variants; issue 27's table)
GUARD_VARIANTS = {
    "saferun+spikes": {"spikes": "raise"},
    "saferun+check_params": {"check_params": True},
    "saferun+anomaly_replay": {"anomaly_replay": True},
    "saferun+strict": {"spikes": "raise", "check_params": True, "anomaly_replay": True},
    "saferun+sync_audit": {"sync_audit": True},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each variant (default 3)")
    p.add_argument("--workloads", help="comma-separated: mlp, cnn, charlm (default: all; --smoke: mlp)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="comma-separated, in run order: " + ", ".join(VARIANTS + tuple(GUARD_VARIANTS)))
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: the CPU, then CUDA when available (default)")
    p.add_argument("--smoke", action="store_true",
                   help=f"{SMOKE['steps']} steps, one repetition, no anomaly variant")
    p.add_argument("--report-dir", default=os.path.join(REPO, ".bench"))
    args = p.parse_args()

    variants = args.variants.split(",")
    workloads = (args.workloads or ("mlp" if args.smoke else ",".join(SCHEDULES))).split(",")
    unknown = set(variants) - set(VARIANTS) - set(GUARD_VARIANTS) or set(workloads) - set(SCHEDULES)
    if unknown:
        p.error(f"unknown: {', '.join(sorted(unknown))}")
    if args.smoke:
        args.repeats = 1
        variants = [v for v in variants if v != "hand+anomaly"]
    if "lightning" in variants and importlib.util.find_spec("lightning") is None:
        print("lightning is not installed (pip install -e '.[bench]'): its variant is skipped")
        variants.remove("lightning")
    devices = ["cpu"] if args.device in ("auto", "cpu") else []
    if args.device in ("auto", "cuda"):
        if cuda_available():
            devices.append("cuda")
        else:
            print("no CUDA device: the GPU benchmark is skipped")
            if args.device == "cuda":
                return

    os.makedirs(os.path.join(args.report_dir, "logs"), exist_ok=True)
    env = environment("cuda" in devices)
    results: list[dict[str, Any]] = []
    started = time.perf_counter()
    for device in devices:
        for workload in workloads:
            schedule = {**SCHEDULES[workload], **SMOKE} if args.smoke else SCHEDULES[workload]
            for rep in range(args.repeats):
                for variant in variants:
                    r = run_one(variant, workload, device, schedule, rep, args.report_dir)
                    results.append(r)
                    print(f"{device} {workload} {variant:<13} run {rep + 1}/{args.repeats}: "
                          f"{r['step_mean_ms']:.3f} ms/step, {r['step_cpu_ms']:.3f} CPU ms/step, "
                          f"val/loss {r['metrics']['val/loss']:.6f}",
                          flush=True)
    env["wall_minutes"] = round((time.perf_counter() - started) / 60, 1)
    report = render(results, env, " ".join(["python", "benchmarks/run.py"] + sys.argv[1:]))
    print("\n" + report)
    with open(os.path.join(args.report_dir, "results.md"), "w") as f:
        f.write(report)
    with open(os.path.join(args.report_dir, "results.json"), "w") as f:
        json.dump({"environment": env, "runs": results}, f, indent=1)


def run_one(variant: str, workload: str, device: str, schedule: dict[str, int], rep: int,
            report_dir: str) -> dict[str, Any]:
    """One fresh process running one variant; the first repetition also counts syncs."""
    base, _, extra = variant.partition("+")
    with tempfile.TemporaryDirectory(prefix="saferun-bench-") as tmp:
        job = {"workload": workload, "device": device, "run_dir": tmp, **schedule,
               **({"guards": GUARD_VARIANTS[variant]} if variant in GUARD_VARIANTS else {})}
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, os.path.join(HERE, "job.py"), "--variant", base,
               "--job", json.dumps(job), "--out", out]
        if extra == "anomaly" and base == "hand":
            cmd.append("--anomaly")
        elif rep == 0:
            cmd.append("--count-syncs")
        log_path = os.path.join(report_dir, "logs", f"{device}-{workload}-{variant}-{rep + 1}.log")
        # One intra-op thread everywhere: the job calls torch.set_num_threads(1), and this keeps
        # any other OpenMP user in the process from spinning up a pool of its own.
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with open(log_path, "w") as log:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=HERE)
        if proc.returncode != 0:
            with open(log_path) as log:
                tail = log.read()[-3000:]
            raise SystemExit(f"{variant} on {workload}/{device} failed (exit {proc.returncode}); "
                             f"log {log_path}:\n{tail}")
        with open(out) as f:
            result = json.load(f)
    result["variant"], result["rep"] = variant, rep
    result["job"].pop("run_dir")
    result["job"].pop("guards", None)
    return result


def cuda_available() -> bool:
    import torch  # here only: the runs import torch themselves, and it takes seconds

    return torch.cuda.is_available()


def environment(cuda: bool) -> dict[str, Any]:
    """Versions and machine, for the report."""
    def version(package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    env = {"python": platform.python_version(), "torch": version("torch"),
           "lightning": version("lightning"), "saferun": version("saferun"),
           "cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform()}
    if cuda:
        import torch

        env["gpu"] = torch.cuda.get_device_name(0)
    env["commit"] = git_commit()
    return env


def git_commit() -> str:
    """The checkout's commit, marked '+changes' when saferun/ or benchmarks/ differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True).stdout
    try:
        commit = git("rev-parse", "--short", "HEAD").strip()
        dirty = git("status", "--porcelain", "--", "saferun", "benchmarks").strip()
    except OSError:
        return "unknown"
    return (commit or "unknown") + (" +changes" if dirty else "")


def render(results: list[dict[str, Any]], env: dict[str, Any], command: str) -> str:
    """The report as Markdown: one table per device and workload."""
    lines = [f"Command: `{command}`", "",
             f"Python {env['python']}, torch {env['torch']}, lightning {env['lightning']}, "
             f"saferun {env['saferun']} (commit {env['commit']}); {env['cores']} cores, {env['cpu']}"
             + (f", {env['gpu']}" if "gpu" in env else "") + f"; {env['wall_minutes']} min.", ""]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["job"]["device"], r["job"]["workload"]), []).append(r)
    for (device, workload), runs in groups.items():
        lines += render_group(device, workload, runs)
    return "\n".join(lines) + "\n"


def render_group(device: str, workload: str, runs: list[dict[str, Any]]) -> list[str]:
    job = runs[0]["job"]
    reps = 1 + max(r["rep"] for r in runs)
    cuda = device == "cuda"
    lines = [f"### {workload} on {device}: {job['steps']} steps of batch {job['batch_size']}, "
             f"log every {job['log_every']}, validate every {job['val_every']} "
             f"(timed: steps {job['warmup'] + 1}-{job['steps']}, {reps} runs each)", "",
             "| variant | ms/step | min-max | vs hand | CPU ms/step | min-max | vs hand "
             "| host syncs per step between log points | host syncs, whole run "
             + ("| CUDA syncs per step between log points | CUDA syncs, whole run " if cuda else "")
             + "| peak RSS, MiB | val loss | val acc |",
             "|---" * (14 if cuda else 12) + "|"]
    by_variant: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by_variant.setdefault(r["variant"], []).append(r)
    hand = {r["rep"]: r for r in by_variant.get("hand", [])}
    sites: list[str] = []
    for variant, rs in by_variant.items():
        means = [r["step_mean_ms"] for r in rs]
        cpus = [r["step_cpu_ms"] for r in rs]
        counted = next((r for r in rs if "host_syncs" in r), None)
        losses = {round(r["metrics"]["val/loss"], 6) for r in rs}
        cells = [variant, f"{statistics.median(means):.3f}", f"{min(means):.3f}-{max(means):.3f}",
                 paired_ratio(rs, hand, "step_mean_ms"),
                 f"{statistics.median(cpus):.3f}", f"{min(cpus):.3f}-{max(cpus):.3f}",
                 paired_ratio(rs, hand, "step_cpu_ms")]
        kinds = ("host", "cuda") if cuda else ("host",)
        for kind in kinds:
            if counted is None:
                cells += ["not counted", ""]
            else:
                c = counted[kind]
                cells += [f"{c['plain_step_syncs'] / c['plain_steps']:.3g} "
                          f"({c['plain_step_syncs']} in {c['plain_steps']} steps)",
                          str(counted[f"{kind}_syncs"])]
        rs0 = rs[0]["metrics"]
        cells += [f"{statistics.median(r['peak_rss_mib'] for r in rs):.0f}",
                  f"{rs0['val/loss']:.6f}" + ("" if len(losses) == 1 else " (runs differ)"),
                  f"{rs0['val/acc']:.4f}"]
        lines.append("| " + " | ".join(cells) + " |")
        if counted is not None:
            where = ", ".join(f"`{s}` x{n}" for s, n in counted["host_sites"]) or "none"
            sites.append(f"- {variant}: {where}")
    lines += ["", "Where the host syncs were (whole counted run):", *sites, ""]
    return lines


def paired_ratio(runs: list[dict[str, Any]], hand: dict[int, dict[str, Any]], key: str) -> str:
    """Median of run-by-run ratios to the hand-written loop's run of the same repetition."""
    ratios = [r[key] / hand[r["rep"]][key] for r in runs if r["rep"] in hand]
    if not ratios:
        return "n/a"
    return f"{statistics.median(ratios):.3f}x"


if __name__ == "__main__":
    main()
