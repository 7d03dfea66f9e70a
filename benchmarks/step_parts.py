"""Where saferun's extra step time goes: saferun's step with one part taken out at a time.

    python benchmarks/step_parts.py                 # MLP, 2000 rounds of every arm
    python benchmarks/step_parts.py --workload cnn --rounds 500

A diagnostic next to `step_micro.py`, with the same models, batches and clocks. Each "arm" is
its own copy of the model and optimizer (same initial weights) driven by one variant of the
step; a round runs every arm once on the same batch, in a fresh random order each round, and
each arm's thread CPU time is compared with saferun's full step in the same round (median of
the per-round ratios, with a bootstrap 95 % interval). The order matters: a step runs faster
right after a step that ran the same Python code, so a fixed or rotated order would favour the
arms that happen to follow a similar one. Arms:

- `hand`: the hand-written step of step_micro.py;
- `saferun, a second copy (control)`: what the design reports for no difference;
- `hand, parameter list`: the same, clipping a list built once instead of walking
  `model.parameters()` every step as the hand loop does;
- `saferun`: `Trainer.train_step` with the benchmark job's config, every default guard on;
- `saferun - X`: the same, with X removed. `guards.declared_modes=false` is a config switch;
  the other parts are replaced by trivial stand-ins while that arm's step runs (never while
  another arm runs), which reaches into saferun's internals as of this commit:
  `saferun.trainer.move_to_device`, `saferun.trainer.StepOutput`, `Trainer._scaler`. When
  those move, update this file.

Every arm must end with the same weights and optimizer state as the others (checked).
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import saferun.trainer as trainer_module
from loop_saferun import BenchTrainer
from step_micro import build, check_same_state


class _PassThroughScaler:
    """What a disabled GradScaler does, as plain methods."""

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def update(self) -> None:
        pass


def _no_move(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    return batch  # CPU batches are on the device already


def _no_output(**fields: Any) -> None:
    return None


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def hand_with_list(model: nn.Module, opt: torch.optim.Optimizer, device: torch.device,
                   max_grad_norm: float) -> Callable[[Any], torch.Tensor]:
    params = list(model.parameters())

    def step(micro_batches: Any) -> torch.Tensor:
        x, y = micro_batches[0]
        x, y = x.to(device, non_blocking=False), y.to(device, non_blocking=False)
        with contextlib.nullcontext():
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        nn.utils.clip_grad_norm_(params, max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


@dataclass
class Arm:
    name: str
    step: Callable[[Any], Any]
    model: nn.Module
    optimizer: torch.optim.Optimizer
    context: Callable[[], ContextManager[None]] = contextlib.nullcontext  # around its step only


def arms(workload: str, tmp: str, n_batches: int) -> tuple[BenchTrainer, list[Arm], list]:
    """saferun's trainer (the reference), every arm (it first), and the batches."""
    ref, hand, model, opt, groups = build(workload, tmp, n_batches)
    out = [Arm("saferun", ref.train_step, ref.model, ref.optimizer),
           Arm("hand", hand, model, opt)]
    t = build(workload, tmp, 1)[0]
    out.append(Arm("saferun, a second copy (control)", t.train_step, t.model, t.optimizer))
    _, _, model, opt, _ = build(workload, tmp, 1)
    out.append(Arm("hand, parameter list", hand_with_list(model, opt, ref.device, 1.0), model, opt))

    def trainer(**guards: Any) -> BenchTrainer:
        return build(workload, tmp, 1, guards)[0]

    t = trainer(declared_modes=False)
    out.append(Arm("saferun - declared-modes check", t.train_step, t.model, t.optimizer))
    t = trainer()
    out.append(Arm("saferun - move_to_device", t.train_step, t.model, t.optimizer,
                   lambda: _patched(trainer_module, "move_to_device", _no_move)))
    t = trainer()
    out.append(Arm("saferun - StepOutput", t.train_step, t.model, t.optimizer,
                   lambda: _patched(trainer_module, "StepOutput", _no_output)))
    t = trainer()
    t._scaler = _PassThroughScaler()  # type: ignore[assignment]
    out.append(Arm("saferun - GradScaler calls (plain object)", t.train_step, t.model,
                   t.optimizer))

    @contextlib.contextmanager
    def both() -> Iterator[None]:
        with _patched(trainer_module, "move_to_device", _no_move), \
                _patched(trainer_module, "StepOutput", _no_output):
            yield

    t = trainer(declared_modes=False)
    t._scaler = _PassThroughScaler()  # type: ignore[assignment]
    out.append(Arm("saferun - all four above", t.train_step, t.model, t.optimizer, both))
    return ref, out, groups


def rounds(arm_list: list[Arm], groups: list, n: int, seed: int = 0) -> np.ndarray:
    """Thread CPU ns of every arm in each of `n` rounds, shape (n, arms)."""
    k = len(arm_list)
    times = np.empty((n, k), dtype=np.int64)
    cpu = time.thread_time_ns
    # A fresh random order each round: a step runs faster right after one that ran the same
    # Python code (warm caches), so a fixed or rotated order would favour some arms.
    orders = np.random.default_rng(seed).permuted(np.tile(np.arange(k), (n, 1)), axis=1)
    for r in range(n):
        group = groups[r % len(groups)]
        for a in orders[r]:
            arm = arm_list[a]
            with arm.context():
                c0 = cpu()
                arm.step(group)
                c1 = cpu()
            times[r, a] = c1 - c0
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=("mlp", "cnn"), default="mlp")
    p.add_argument("--rounds", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=100)
    args = p.parse_args()

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="saferun-parts-") as tmp:
        ref, arm_list, groups = arms(args.workload, tmp, 64)
        rounds(arm_list, groups, args.warmup, seed=1)
        times = rounds(arm_list, groups, args.rounds) / 1e3
        for arm in arm_list[1:]:  # every arm did the same arithmetic as saferun's full step
            check_same_state(ref, arm.model, arm.optimizer)
    rng = np.random.default_rng(0)
    print(f"{args.workload}: {args.rounds} rounds of {len(arm_list)} arms, thread CPU time; "
          f"median step: saferun {np.median(times[:, 0]):.1f} us, "
          f"hand {np.median(times[:, 1]):.1f} us")
    print(f"  {'arm':<44} {'vs saferun, per-round median':>30}  95% CI")
    for a, arm in enumerate(arm_list[1:], start=1):
        # Ratios: when the machine slows down, both steps of a round slow down alike.
        r = times[:, a] / times[:, 0] - 1
        boot = np.median(r[rng.integers(0, len(r), size=(1000, len(r)))], axis=1)
        lo, hi = np.percentile(boot, [2.5, 97.5])
        d = np.median(times[:, a] - times[:, 0])
        print(f"  {arm.name:<44} {100 * np.median(r):>+7.2f}% ({d:>+6.1f} us)  "
              f"[{100 * lo:+.2f}%, {100 * hi:+.2f}%]")

if __name__ == "__main__":
    main()
