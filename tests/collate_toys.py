"""Collate functions for the collate_fn tests, importable by spawned DataLoader workers."""

from __future__ import annotations

from typing import Any

import torch


def dict_collate(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    """(x, y) samples to {"x", "y", "n"}: a batch torch's default_collate would not build."""
    return {"x": torch.stack([x for x, _ in samples]), "y": torch.stack([y for _, y in samples]),
            "n": len(samples)}


class ScaledCollate:
    """A configurable collate_fn: dict_collate with x multiplied by `scale`."""

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale

    def __call__(self, samples: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
        batch = dict_collate(samples)
        batch["x"] = batch["x"] * self.scale
        return batch
