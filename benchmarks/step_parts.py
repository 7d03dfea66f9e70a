"""Where saferun's extra step time goes: saferun's step with one part taken out at a time.

    python benchmarks/step_parts.py                 # MLP, 2000 rounds of every arm
    python benchmarks/step_parts.py --workload cnn --rounds 500

A diagnostic next to `step_micro.py`, with the same trainer, batches and clock. Each "arm" is
one variant of the step; all of them train the same model with the same optimizer (saferun's),
so that they differ only in the code that runs, not in where their tensors live. A round runs
every arm once on the same batch, in a fresh random order each round, and each arm's thread CPU
time is compared with saferun's full step in the same round (median of the per-round ratios,
with a bootstrap 95 % interval). The order matters: a step runs faster right after a step that
ran the same Python code (warm caches), so a fixed or rotated order would favour the arms that
happen to follow a similar one. Arms:

- `hand`: the hand-written step of step_micro.py;
- `saferun again (control)`: saferun's full step a second time: what the design reports for
  no difference;
- `hand, parameter list`: the hand step clipping a list built once instead of walking
  `model.parameters()` every step as the hand loop does;
- `saferun - X`: `Trainer.train_step` with X replaced by a trivial stand-in while that arm's
  step runs (never while another arm runs). The removed parts do no tensor arithmetic, so every
  arm dispatches the same torch ops. This reaches into saferun's internals as of this commit:
  `Trainer._guards` (the step guards' after_backward hooks: the declared-modes check),
  `Trainer._scaler`, `saferun.loop.frame.move_to_device` and `saferun.trainer.StepOutput`;
  when those move, update this file. (Since issue 37 the step calls no GradScaler method
  outside fp16, so the GradScaler arm runs the same code as the full step.)
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
import saferun.loop.frame as frame_module
from step_micro import build, hand_step


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
    context: Callable[[], ContextManager[None]] = contextlib.nullcontext  # around its step only


def arms(workload: str, tmp: str, n_batches: int) -> tuple[list[Arm], list]:
    """Every arm (saferun's full step first), all on one trainer, model and optimizer."""
    t, _, _, _, groups = build(workload, tmp, n_batches)
    max_norm = t.cfg.trainer.max_grad_norm
    out = [Arm("saferun", t.train_step),
           Arm("hand", hand_step(t.model, t.optimizer, t.device, max_norm)),
           Arm("saferun again (control)", t.train_step),
           Arm("hand, parameter list", hand_with_list(t.model, t.optimizer, t.device, max_norm)),
           Arm("saferun - declared-modes check", t.train_step,
               lambda: _patched(t._guards, "after_backward", ())),
           Arm("saferun - move_to_device", t.train_step,
               lambda: _patched(frame_module, "move_to_device", _no_move)),
           Arm("saferun - StepOutput", t.train_step,
               lambda: _patched(trainer_module, "StepOutput", _no_output)),
           Arm("saferun - GradScaler calls (plain object)", t.train_step,
               lambda: _patched(t, "_scaler", _PassThroughScaler()))]

    @contextlib.contextmanager
    def all_four() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for arm in out[4:8]:
                stack.enter_context(arm.context())
            yield

    out.append(Arm("saferun - all four above", t.train_step, all_four))
    return out, groups


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
        arm_list, groups = arms(args.workload, tmp, 64)
        rounds(arm_list, groups, args.warmup, seed=1)
        times = rounds(arm_list, groups, args.rounds) / 1e3
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
