"""saferun: a PyTorch training loop that gets the mode and gradient discipline right by default."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .callbacks import Callback, Control, StepOutput, TrainerView
    from .config import Config, TrainerConfig, load_config
    from .errors import ConfigError, SaferunError
    from .trainer import Trainer
    from .checkpoint.weights import load_model

from .version import __version__

# Exports are imported on first use, so that `saferun run --help` or a config
# error answers without first importing torch.
_EXPORTS = {
    "Callback": "callbacks", "Control": "callbacks", "StepOutput": "callbacks",
    "TrainerView": "callbacks", "Config": "config", "TrainerConfig": "config",
    "load_config": "config", "ConfigError": "errors", "SaferunError": "errors",
    "Trainer": "trainer", "load_model": "checkpoint.weights",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'saferun' has no attribute {name!r}")
