"""saferun: a PyTorch training loop that gets the mode and gradient discipline right by default."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers: the lazy exports below (F401: used through __getattr__)
    from .callbacks import Callback, Control, StepOutput, TrainerView  # noqa: F401
    from .config import Config, TrainerConfig, load_config  # noqa: F401
    from .errors import ConfigError, SaferunError  # noqa: F401
    from .trainer import Trainer  # noqa: F401
    from .checkpoint.weights import load_model  # noqa: F401

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
    return submodule(__name__, name)


def submodule(package: str, name: str) -> Any:
    """`package.name` imported on first use, so that a dotted name the docs write
    (`saferun.stopping.EarlyStopping`) works after `import saferun` alone."""
    if not name.startswith("_"):
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{package}.{name}":  # a module that is there but fails to import
                raise
    raise AttributeError(f"module {package!r} has no attribute {name!r}")
