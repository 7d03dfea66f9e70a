"""The reference for trainer.ema under torchrun: `Trajectory` records the whole weights
(gathered to rank 0, by name, as model.pt holds them) at the start and after every optimizer
step of a run, into <run_dir>/trajectory.pt; `hand_ema` computes the average of that
trajectory in one process, by the definition (W_0^ema = W_0, then a lerp towards each step's
weights; integer buffers copied)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

import saferun


class Trajectory(saferun.Callback):
    def __init__(self, trainer: Optional[saferun.Trainer] = None) -> None:
        self.trainer = trainer  # (set after construction where the trainer is built with it)
        self.weights: list[dict[str, torch.Tensor]] = []

    def on_fit_start(self, view: Any) -> None:
        assert self.trainer is not None
        self.weights.append(self.whole())
        self.trainer.optimizer.register_step_post_hook(lambda *_: self.weights.append(self.whole()))

    def on_fit_end(self, view: Any, metrics: Any) -> None:
        assert self.trainer is not None
        if self.trainer.ranks.is_main:
            torch.save(self.weights, Path(self.trainer.state.run_dir, "trajectory.pt"))

    def whole(self) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        assert self.trainer is not None  # every rank: collectives
        whole = get_model_state_dict(self.trainer.model, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))
        return {k: v.clone() for k, v in whole.items()}  # (buffers on the CPU: the live ones)


def hand_ema(run_dir: Path, decay: float) -> dict[str, torch.Tensor]:
    trajectory = torch.load(run_dir / "trajectory.pt", weights_only=True)
    ema = {k: v.clone() for k, v in trajectory[0].items()}
    for weights in trajectory[1:]:
        for k, v in ema.items():
            if v.is_floating_point():
                v.lerp_(weights[k], 1 - decay)
            else:
                v.copy_(weights[k])
    return ema
