"""Learning-rate schedules stepped once per optimizer step."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                  min_lr_ratio: float = 0.0) -> LambdaLR:
    """Linear warm-up from 0 over `warmup_steps`, then cosine decay to `min_lr_ratio` * lr."""
    if warmup_steps < 0 or total_steps <= 0 or not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(
            f"warmup_cosine needs warmup_steps >= 0, total_steps > 0 and 0 <= min_lr_ratio <= 1; "
            f"got {warmup_steps}, {total_steps}, {min_lr_ratio}.")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)
