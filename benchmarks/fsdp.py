"""DDP against FSDP2 (trainer.strategy=fsdp) on the charlm Transformer: per-rank memory of
parameters, gradients and optimizer state (counted in bytes), peak memory, step time; and the
stall of a checkpoint save on the training thread, synchronous against `trainer.fsdp.async_save`.

    python benchmarks/fsdp.py --nproc 2 --d-model 512 --layers 4 --steps 30      # CPU, gloo
    python benchmarks/fsdp.py --nproc 8 --device cuda --d-model 2048 --layers 16  # GPUs, nccl

It starts one torchrun job per case (ddp, fsdp, fsdp with async saves); each rank trains with
saferun's charlm recipe, then saves a few checkpoints timing each `save()` call, and writes its
figures; the launcher prints a Markdown table (docs/benchmarks.md has the results).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

CASES: dict[str, dict[str, Any]] = {"ddp": {"strategy": "ddp"}, "fsdp": {"strategy": "fsdp"},
         "fsdp+async": {"strategy": "fsdp", "fsdp": {"async_save": True}}}


def rank_main(args: argparse.Namespace) -> None:
    import torch

    import saferun
    from saferun.recipes.charlm import CharLMTrainer

    case = CASES[args.case]
    cfg = {"model": {"_target_": "saferun.recipes.charlm.CharTransformer", "d_model": args.d_model,
                     "layers": args.layers, "heads": 8, "context": 64},
           "data": {"_target_": "saferun.recipes.charlm.datasets", "context": 64,
                    "max_chars": 300_000},
           "optim": {"_target_": "torch.optim.AdamW", "lr": 1e-3}, "logger": {},
           "trainer": {"max_steps": args.steps, "batch_size": args.batch_size, "device": args.device,
                       "log_every_n_steps": 10, "val_every_n_steps": 10**6, "limit_val_batches": 1,
                       "save_every_n_steps": None, "progress_bar": False,
                       "run_dir": os.path.join(args.out, args.case), **case}}
    times: list[float] = []

    class Clock(saferun.Callback):
        def on_train_step_end(self, view: Any, output: Any) -> None:
            if args.device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter())

    trainer = CharLMTrainer(cfg, callbacks=[Clock()], sample_chars=0)
    trainer.fit()
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    nbytes = lambda ts: sum(local(t).numel() * local(t).element_size() for t in ts)  # noqa: E731
    params = list(trainer.model.parameters())
    optim = [v for s in trainer.optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor) and v.ndim > 0]
    stalls = []
    for _ in range(args.saves):  # the training thread's wait per save; writes finish between
        trainer.state.step += 1
        start = time.perf_counter()
        trainer._checkpointer.save()
        stalls.append(time.perf_counter() - start)
        time.sleep(args.gap)  # training would go on here
    trainer._strategy.checkpoint_format.finish()  # the last save, if still in flight
    steady = [b - a for a, b in zip(times, times[1:])][args.warmup:]
    peak = (torch.cuda.max_memory_allocated() if args.device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    result = {"case": args.case, "rank": trainer.ranks.rank,
              "param_bytes": nbytes(params), "grad_bytes": nbytes(params),  # grads shard like params
              "optim_bytes": nbytes(optim), "whole_param_bytes": sum(p.numel() * 4 for p in params),
              "peak_bytes": peak, "step_ms": 1000 * sum(steady) / max(len(steady), 1),
              "save_stall_ms": [1000 * s for s in stalls]}
    with open(os.path.join(args.out, f"{args.case}_rank{trainer.ranks.rank}.json"), "w") as f:
        json.dump(result, f)


def launch(args: argparse.Namespace) -> None:
    out = args.out or tempfile.mkdtemp(prefix="fsdp-bench-")
    rows = []
    for case in args.cases.split(","):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
               f"--master_port={port}", __file__, "--rank-main", "--case", case, "--out", out,
               *(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                 if k in ("d_model", "layers", "steps", "batch_size", "device", "warmup", "saves", "gap"))]
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
        ranks = [json.load(open(os.path.join(out, f"{case}_rank{r}.json"))) for r in range(args.nproc)]
        rows.append(ranks)
    mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    print(f"\n{args.nproc} processes, {args.device}, charlm d_model {args.d_model}, {args.layers} "
          f"layers, batch {args.batch_size}x64 per rank, AdamW; step time: mean of steps "
          f"{args.warmup + 2}-{args.steps}; save stall: mean of saves 2-{args.saves}\n")
    print("| case | params MiB/rank | grads MiB/rank | AdamW state MiB/rank | peak MiB/rank "
          "| step ms | save stall ms |")
    print("|---|---|---|---|---|---|---|")
    for ranks in rows:
        r0 = ranks[0]
        stall = [sum(r["save_stall_ms"][1:]) / max(len(r["save_stall_ms"]) - 1, 1) for r in ranks]
        print(f"| {r0['case']} | {mib(r0['param_bytes'])} | {mib(r0['grad_bytes'])} | "
              f"{mib(r0['optim_bytes'])} | {mib(max(r['peak_bytes'] for r in ranks))} | "
              f"{max(r['step_ms'] for r in ranks):.0f} | {max(stall):.0f} |")
    print(f"\nwhole model: {mib(rows[0][0]['whole_param_bytes'])} MiB of fp32 parameters; "
          f"figures in {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--case", default="fsdp")
    p.add_argument("--cases", default="ddp,fsdp,fsdp+async")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--saves", type=int, default=4)
    p.add_argument("--gap", type=float, default=2.0, help="seconds between the timed saves")
    p.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rank_main(args) if args.rank_main else launch(args)


if __name__ == "__main__":
    main()
