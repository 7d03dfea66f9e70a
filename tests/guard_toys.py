"""Datasets and transforms for the guard tests; module level, so spawned workers can import them."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler


class Compose:
    """A torchvision-style chain of transforms, kept in a `transforms` list."""

    def __init__(self, transforms: Sequence[Callable[[Any], Any]]) -> None:
        self.transforms = list(transforms)

    def __call__(self, x: Any) -> Any:
        for t in self.transforms:
            x = t(x)
        return x


class Scale:
    """A picklable transform: a module-level class with __call__."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class Shifter:
    """Its bound method `shift` is a picklable transform."""

    def __init__(self, amount: float) -> None:
        self.amount = amount

    def shift(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.amount


class TransformDataset(Dataset):
    """Sample i is transform(tensor(i)); may also hold any extra object (a lock, a cache)."""

    def __init__(self, n: int = 8, transform: Optional[Callable[[Any], Any]] = None,
                 extra: Any = None) -> None:
        self.n = n
        self.transform = transform
        self.extra = extra

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        x = torch.tensor(float(i))
        return self.transform(x) if self.transform is not None else x


class RngDataset(Dataset):
    """Every sample is one draw from the generator object stored on the dataset."""

    def __init__(self, rng: Any, n: int = 8) -> None:
        self.rng = rng
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if isinstance(self.rng, torch.Generator):
            return torch.rand((), generator=self.rng, dtype=torch.float64)
        return torch.tensor(float(self.rng.random()), dtype=torch.float64)


class KeySampler(Sampler):
    """A sampler holding a lambda; samplers stay in the main process, so this is fine."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.key = lambda i: i

    def __len__(self) -> int:
        return self.n

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(sorted(range(self.n), key=self.key))


def make_local_function() -> Callable[[torch.Tensor], torch.Tensor]:
    def double(x: torch.Tensor) -> torch.Tensor:
        return 2 * x
    return double


def rng_draws(rng: Any) -> list[float]:
    return [float(rng.random()) for _ in range(2)] if not isinstance(rng, np.ndarray) else []
