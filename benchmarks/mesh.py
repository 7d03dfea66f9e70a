"""saferun's step on a 2-D device mesh (trainer.strategy=mesh, dp_shard 2 x tp 2) against a
hand-written torch loop applying the same plan, on the charlm recipe's Transformer.

    python benchmarks/mesh.py                                  # 5 interleaved rounds, 4 CPU processes
    python benchmarks/mesh.py --rounds 1 --steps 6 --warmup 2 --log-every 2   # does it run?
    python benchmarks/mesh.py --device cuda --d-model 1024 --layers 8          # 4 GPUs, nccl

Both arms run under torchrun (4 processes; gloo on the CPU, one thread each) and do the same
work: `CharTransformer` built from the same seed; in each block `qkv` and `mlp.0` split by
output (`ColwiseParallel`), `proj` and `mlp.2` by input (`RowwiseParallel`) over mesh["tp"],
then FSDP2 (`fully_shard`) on each block and the root over mesh["dp_shard"]; AdamW (lr 1e-3);
the gradients clipped at 1.0 by the norm of the whole model (DTensors on two meshes: each
mesh's norm, then theirs); the same fixed batches (synthetic token windows, split over the data
dimension by a `DistributedSampler` without shuffling); the loss read every `--log-every` steps,
averaged over the data ranks. saferun runs the charlm recipe's trainer (its `parallelize` is
that plan) with its defaults; the hand loop is the plain step.

A run's time per step is rank 0's wall time from the end of step `--warmup` to the end of the
last step, divided by the steps between (log points included). A round runs each arm once in a
fresh job, in an order that alternates from round to round; the headline is the median over
rounds of saferun's time over the hand loop's. The launcher first checks that the two arms
logged the same losses (relative 1e-4: the same arithmetic, but saferun averages the window in
float64), so that the comparison is of the same work. docs/benchmarks.md has the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ARMS = ("hand", "saferun")
HEADS, CONTEXT = 4, 64
DP, TP = 2, 2  # the mesh: 4 processes


def windows(args: argparse.Namespace) -> Any:
    """Fixed token windows (inputs, next characters), one epoch of the run's steps."""
    import torch
    from torch.utils.data import TensorDataset

    from saferun.recipes.charlm import VOCAB

    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, len(VOCAB), (args.steps * args.batch_size * DP, CONTEXT + 1), generator=g)
    return TensorDataset(ids[:, :-1], ids[:, 1:])


def data(args: argparse.Namespace, dataset: Any, dp_rank: int) -> Any:
    """The same batches for both arms: `dataset` split over the data ranks, in order."""
    from torch.utils.data import DataLoader, DistributedSampler

    sampler: DistributedSampler[Any] = DistributedSampler(dataset, num_replicas=DP, rank=dp_rank,
                                                          shuffle=False)
    return DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)


def tp_plan() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"qkv": ColwiseParallel(), "proj": RowwiseParallel(), "mlp.0": ColwiseParallel(),
            "mlp.2": RowwiseParallel()}


def hand(args: argparse.Namespace) -> tuple[list[float], dict[int, float]]:
    """The plain 2-D step, written out with torch's own parts."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from saferun.recipes.charlm import CharTransformer

    device = torch.device(args.device, int(os.environ["LOCAL_RANK"]) if args.device == "cuda" else 0)
    if args.device == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    mesh = init_device_mesh(args.device, (DP, TP), mesh_dim_names=("dp_shard", "tp"))
    torch.manual_seed(0)
    model = CharTransformer(context=CONTEXT, d_model=args.d_model, layers=args.layers,
                            heads=HEADS).to(device)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], tp_plan())
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    meshes: dict[Any, list[Any]] = {}  # clip_grad_norm_ cannot stack norms of two meshes
    for p in params:
        meshes.setdefault(p.device_mesh, []).append(p)  # type: ignore[attr-defined]
    dp = mesh["dp_shard"]
    times, losses, window = [], {}, torch.zeros((), device=device)
    for step, (x, y) in enumerate(data(args, windows(args), dp.get_local_rank()), start=1):
        x, y = x.to(device), y.to(device)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        norms = [torch.nn.utils.get_total_norm([p.grad for p in g]).full_tensor()  # type: ignore[attr-defined]
                 for g in meshes.values()]  # each mesh's norm: a DTensor
        norm = torch.linalg.vector_norm(torch.stack(norms))
        for g in meshes.values():
            torch.nn.utils.clip_grads_with_norm_(g, 1.0, norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        window += loss.detach()
        if step % args.log_every == 0:
            dist.all_reduce(window, group=dp.get_group())
            losses[step] = window.item() / (args.log_every * DP)
            window.zero_()
        if args.device == "cuda" and step in (args.warmup, args.steps):
            torch.cuda.synchronize()
        times.append(time.perf_counter())
    dist.destroy_process_group()
    return times, losses


def with_saferun(args: argparse.Namespace, out: str) -> tuple[list[float], dict[int, float]]:
    import torch

    import saferun
    from saferun.recipes.charlm import CharLMTrainer

    times: list[float] = []
    losses: dict[int, float] = {}

    class Clock(saferun.Callback):
        def on_train_step_end(self, view: Any, output: Any) -> None:
            if args.device == "cuda" and view.step in (args.warmup, args.steps):
                torch.cuda.synchronize()
            times.append(time.perf_counter())

        def on_log(self, view: Any, metrics: Any) -> None:
            if "train/loss" in metrics:
                losses[view.step] = metrics["train/loss"]

    class Bench(CharLMTrainer):
        def build_datasets(self) -> Any:
            return windows(args), None

        def build_dataloaders(self, train: Any, val: Any) -> Any:
            return data(args, train, self.data_ranks.rank), None  # as the hand loop's

    cfg = {"model": {"_target_": "saferun.recipes.charlm.CharTransformer", "d_model": args.d_model,
                     "layers": args.layers, "heads": HEADS, "context": CONTEXT},
           "optim": {"_target_": "torch.optim.AdamW", "lr": 1e-3}, "logger": {},
           "trainer": {"strategy": "mesh", "parallel": {"dp_shard": DP, "tp": TP}, "max_steps": args.steps,
                       "batch_size": args.batch_size, "device": args.device, "max_grad_norm": 1.0,
                       "log_every_n_steps": args.log_every, "save_every_n_steps": None,
                       "progress_bar": False,
                       "run_dir": os.path.join(out, "saferun-run")}}
    Bench(cfg, callbacks=[Clock()], sample_chars=0).fit()
    return times, losses


def rank_main(args: argparse.Namespace) -> None:
    times, losses = (hand if args.arm == "hand" else lambda a: with_saferun(a, args.out))(args)
    if os.environ.get("RANK", "0") != "0":
        return
    assert len(times) == args.steps, f"{len(times)} steps timed of {args.steps}"
    window = times[args.warmup - 1:]  # times[k - 1] ends step k
    with open(os.path.join(args.out, f"{args.arm}.json"), "w") as f:
        json.dump({"ms_per_step": 1e3 * (window[-1] - window[0]) / (args.steps - args.warmup),
                   "losses": losses}, f)


def run_arm(args: argparse.Namespace, arm: str, out: str) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={DP * TP}",
           f"--master_port={port}", __file__, "--rank-main", "--arm", arm, "--out", out,
           *(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
             if k in ("d_model", "layers", "steps", "batch_size", "device", "warmup", "log_every"))]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    with open(os.path.join(out, f"{arm}.json")) as f:
        return json.load(f)


def check_same_work(rounds: list[dict[str, Any]]) -> float:
    """The largest relative difference of the logged losses between the arms (exits if over 1e-4)."""
    worst = 0.0
    for r in rounds:
        want, got = r["hand"]["losses"], r["saferun"]["losses"]
        if not want or want.keys() != got.keys():
            sys.exit(f"the arms logged the loss at different steps: {sorted(want)} and {sorted(got)}")
        worst = max(worst, *(abs(got[k] - want[k]) / abs(want[k]) for k in want))
    if worst > 1e-4:
        sys.exit(f"the arms' losses differ by up to {worst:.2e} (relative): not the same work")
    return worst


def launch(args: argparse.Namespace) -> None:
    out = args.out or tempfile.mkdtemp(prefix="mesh-bench-")
    rounds = []
    for i in range(args.rounds):
        where = os.path.join(out, f"round{i}")
        os.makedirs(where, exist_ok=True)
        order = ARMS if i % 2 == 0 else ARMS[::-1]  # drift of the machine falls on both
        rounds.append({arm: run_arm(args, arm, where) for arm in order})
    worst = check_same_work(rounds)
    ratios = [r["saferun"]["ms_per_step"] / r["hand"]["ms_per_step"] for r in rounds]
    print(f"\n4 processes (dp_shard 2 x tp 2), {args.device}, charlm d_model {args.d_model}, "
          f"{args.layers} layers, batch {args.batch_size}x{CONTEXT} per data rank, AdamW, clip 1.0; "
          f"ms per step over steps {args.warmup + 1}-{args.steps}; losses agree within "
          f"{worst:.1e} (relative)\n")
    print("| round | hand ms/step | saferun ms/step | ratio |")
    print("|---|---|---|---|")
    for i, (r, ratio) in enumerate(zip(rounds, ratios)):
        print(f"| {i + 1} | {r['hand']['ms_per_step']:.2f} | {r['saferun']['ms_per_step']:.2f} "
              f"| {ratio:.3f} |")
    print(f"\nmedian ratio over {len(ratios)} round(s): {statistics.median(ratios):.3f}x; "
          f"figures in {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--arm", choices=ARMS, default="hand", help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.steps % args.log_every or args.warmup < 1 or args.warmup >= args.steps:
        p.error("--steps must be a multiple of --log-every, and 1 <= --warmup < --steps")
    if args.rank_main:
        rank_main(args)
        from saferun.distributed import end_process

        end_process()  # a rank ends before interpreter teardown, where gloo can abort it
    else:
        launch(args)


if __name__ == "__main__":
    main()
