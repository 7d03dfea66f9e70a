"""Seeding: the whole run and every DataLoader worker derive from one seed."""

from __future__ import annotations

import contextlib
import random
from typing import Any, Iterator

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python's `random`, NumPy's global RNG and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def derive_seed(*entropy: int) -> int:
    """A 63-bit seed mixed from the given integers with NumPy's SeedSequence."""
    state = np.random.SeedSequence([e % 2**63 for e in entropy]).generate_state(1, np.uint64)
    return int(state[0]) & (2**63 - 1)


class WorkerSeeder:
    """`worker_init_fn` giving each worker seeds derived from (seed, epoch, worker id, rank).

    torch already gives workers distinct seeds, but from a base seed drawn at
    random per iterator; deriving them from the run seed makes a run with
    workers reproducible and resumable. The Trainer sets `epoch` before each
    epoch's iterator is created (workers are started, and receive a copy of
    this object, at that moment). It is a module-level class so that it
    pickles under the spawn and forkserver start methods.
    """

    def __init__(self, seed: int, rank: int = 0) -> None:
        self.seed = seed
        self.rank = rank
        self.epoch = 0

    def __call__(self, worker_id: int) -> None:
        seed = derive_seed(self.seed, self.epoch, worker_id, self.rank)
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)



def get_rng_state() -> dict[str, Any]:
    """Python, NumPy and torch (CPU and CUDA) RNG states as tensors and plain containers.

    Plain data, so a checkpoint holding it loads with torch.load(weights_only=True).
    """
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"name": name, "keys": keys.tolist(), "pos": int(pos),  # type: ignore[attr-defined]  # the legacy tuple
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `get_rng_state` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["name"], np.array(n["keys"], dtype=np.uint32), n["pos"],
                         n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Run a block without disturbing any RNG the training run depends on."""
    state = get_rng_state()
    try:
        yield
    finally:
        set_rng_state(state)
