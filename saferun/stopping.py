"""Early stopping on a validation metric: a callback that asks the loop to stop."""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

from .callbacks import Callback, Control, TrainerView
from .errors import ConfigError


class EarlyStopping(Callback):
    """Stop when `monitor` has not improved by `min_delta` for `patience` validations.

    A non-finite monitored value stops at once: training on would not bring it back.

    `restore_best=True`: at the end of fit the model holds the weights of the best validation
    (trainer.save_best's checkpoint, so save_best must watch the same metric in the same mode),
    and with trainer.ema the average holds that checkpoint's average. The optimizer, the
    schedule and the step stay the final ones, so a further fit() on that Trainer is refused;
    the files (checkpoints, model.pt with the final weights, model_best.pt) stay as they are.
    fit() returns the final metrics; `trainer.best` says which step the weights are from.
    """

    def __init__(self, monitor: str = "val/loss", mode: str = "min", patience: int = 5,
                 min_delta: float = 0.0, restore_best: bool = False) -> None:
        if mode not in ("min", "max") or patience < 1 or min_delta < 0:
            raise ConfigError(f"EarlyStopping needs mode min or max, patience >= 1 and "
                              f"min_delta >= 0; got {mode!r}, {patience}, {min_delta}.")
        self.monitor, self.mode, self.patience, self.min_delta = monitor, mode, patience, min_delta
        self.restore_best = restore_best
        self.best: Optional[float] = None
        self.bad_validations = 0

    def on_fit_start(self, view: TrainerView) -> None:
        trainer = view.config.get("trainer", {})
        if self.restore_best and (trainer.get("save_best"), trainer.get("save_best_mode")) != (
                self.monitor, self.mode):
            raise ConfigError(
                f"EarlyStopping(monitor={self.monitor!r}, mode={self.mode!r}, restore_best=True) "
                f"restores the checkpoint trainer.save_best keeps, but trainer.save_best="
                f"{trainer.get('save_best')!r} with save_best_mode={trainer.get('save_best_mode')!r}."
                f" Set trainer.save_best={self.monitor} and trainer.save_best_mode={self.mode}.")

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
