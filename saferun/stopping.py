"""Early stopping on a validation metric: a callback that asks the loop to stop."""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

from .callbacks import Callback, Control, TrainerView
from .errors import ConfigError


class EarlyStopping(Callback):
    """Stop when `monitor` has not improved by `min_delta` for `patience` validations.

    A non-finite monitored value stops at once: training on would not bring it back.
    """

    def __init__(self, monitor: str = "val/loss", mode: str = "min", patience: int = 5,
                 min_delta: float = 0.0) -> None:
        if mode not in ("min", "max") or patience < 1 or min_delta < 0:
            raise ConfigError(f"EarlyStopping needs mode min or max, patience >= 1 and "
                              f"min_delta >= 0; got {mode!r}, {patience}, {min_delta}.")
        self.monitor, self.mode, self.patience, self.min_delta = monitor, mode, patience, min_delta
        self.best: Optional[float] = None
        self.bad_validations = 0

    def on_validation_end(self, view: TrainerView, metrics: Mapping[str, float]) -> Optional[Control]:
        if self.monitor not in metrics:
            raise ConfigError(f"EarlyStopping monitors {self.monitor!r}, which validation does "
                              f"not report (it reports {', '.join(metrics)}).")
        value = metrics[self.monitor]
        if not math.isfinite(value):
            return Control(stop=True)
        sign = 1.0 if self.mode == "min" else -1.0
        if self.best is None or sign * (self.best - value) > self.min_delta:
            self.best, self.bad_validations = value, 0
        else:
            self.bad_validations += 1
        return Control(stop=self.bad_validations >= self.patience)

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "bad_validations": self.bad_validations}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best, self.bad_validations = state["best"], state["bad_validations"]
