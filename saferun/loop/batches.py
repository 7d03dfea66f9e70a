"""The epoch / micro-batch stream of the training loop."""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader

from ..data import epoch_state, move_to_device, restore_epoch_state, set_loader_epoch


def take(iterator: Iterator[Any], n: int) -> list[Any]:
    group = []
    for batch in iterator:
        group.append(batch)
        if len(group) == n:
            break
    return group


def first_batch(loader: DataLoader, seed: int, rank: int, device: torch.device,
                non_blocking: bool) -> Any:
    """Epoch 0's first batch on the device, leaving the loader's generators as they were."""
    found = epoch_state(loader)
    try:
        set_loader_epoch(loader, seed, 0, rank)
        return move_to_device(next(iter(loader)), device, non_blocking)
    finally:
        restore_epoch_state(loader, found)
