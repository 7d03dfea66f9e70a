"""Checkpoints: the store (`store`: atomic write, manifest, verify, rotate, through a `Storage`
such as `LocalStorage`), the
formats that hold the model and optimizer (`formats`: whole, or sharded per rank by
`sharded`) and the `Checkpointer` that assembles, finds, resumes and saves the Trainer's
state.

The exports are imported on first use, so that `intent` (written by the command line before
torch is imported) imports nothing heavy."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers: the lazy exports below (F401: used through __getattr__)
    from .store import (FORMAT_VERSION, CheckpointError, LocalStorage, Storage, check_plain,  # noqa: F401
                        checkpoint_root, list_checkpoints, load_checkpoint, load_latest, rotate,
                        save_checkpoint, save_weights)

__all__ = ["FORMAT_VERSION", "CheckpointError", "LocalStorage", "Storage", "check_plain",
           "checkpoint_root", "list_checkpoints", "load_checkpoint", "load_latest", "rotate",
           "save_checkpoint", "save_weights"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module(".store", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
