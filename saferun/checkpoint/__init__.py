"""Checkpoints: the on-disk store (`store`: atomic write, manifest, verify, rotate), the
formats that hold the model and optimizer (`formats`: whole, or sharded per rank by
`sharded`) and the `Checkpointer` that assembles, finds, resumes and saves the Trainer's
state."""

from .store import (FORMAT_VERSION, CheckpointError, check_plain, checkpoint_root, list_checkpoints,
                    load_checkpoint, load_latest, rotate, save_checkpoint, save_weights)

__all__ = ["FORMAT_VERSION", "CheckpointError", "check_plain", "checkpoint_root", "list_checkpoints",
           "load_checkpoint", "load_latest", "rotate", "save_checkpoint", "save_weights"]
