"""`sweep`: what a sweep ranks its jobs by (kept beside the code that reads it; `config.Config`
holds it as a node)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError


@dataclass
class SweepConfig:
    """The objective of a sweep: the summary ranks the jobs by it, an Optuna sweep optimizes it."""

    metric: Optional[str] = None
    """A validation metric (e.g. val/acc); None: trainer.save_best's metric, else val/loss."""
    mode: Optional[str] = None
    """min or max. None: trainer.save_best_mode for save_best's metric, else the direction the
    metric's name says (as trainer.save_best_mode); a name that says none is refused."""

    def __post_init__(self) -> None:
        if self.mode not in (None, "min", "max"):
            raise ConfigError(f"sweep.mode must be min or max, got {self.mode!r}.")
