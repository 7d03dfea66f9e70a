"""Early stopping on a validation metric: a callback that asks the loop to stop."""

from __future__ import annotations

import logging
import math
from typing import Any, Mapping, Optional

from .callbacks import Callback, Control, TrainerView
from .direction import inference_note, infer_mode, metric_mode
from .errors import ConfigError

log = logging.getLogger("saferun")


class EarlyStopping(Callback):
    """Stop when `monitor` has not improved by `min_delta` for `patience` validations.

    A non-finite monitored value stops at once: training on would not bring it back.

    `mode` None: the direction the monitored name says (val/loss: min, val/acc: max; see
    trainer.save_best_mode), said in the log; a name that says none is refused.

    `restore_best=True`: at the end of fit the model holds the weights of the best validation
    (trainer.save_best's checkpoint, so save_best must watch the same metric in the same mode),
    and with trainer.ema the average holds that checkpoint's average. The optimizer, the
    schedule and the step stay the final ones, so a further fit() on that Trainer is refused;
    the files (checkpoints, model.pt with the final weights, model_best.pt) stay as they are.
    fit() returns the final metrics; `trainer.best` says which step the weights are from.
    """

    def __init__(self, monitor: str = "val/loss", mode: Optional[str] = None, patience: int = 5,
                 min_delta: float = 0.0, restore_best: bool = False) -> None:
        if mode not in (None, "min", "max") or patience < 1 or min_delta < 0:
            raise ConfigError(f"EarlyStopping needs mode min or max, patience >= 1 and "
                              f"min_delta >= 0; got {mode!r}, {patience}, {min_delta}.")
        self.monitor, self.patience, self.min_delta = monitor, patience, min_delta
        self.mode = metric_mode(monitor, mode, f"EarlyStopping(monitor={monitor!r})",
                                'EarlyStopping(mode="{mode}")')
        self._unsaid = mode is None  # an inferred direction is said once, at the first fit
        self.restore_best = restore_best
        self.state_key = f"monitor={monitor!r}"  # swapped with another at a resume: each its own
        self.best: Optional[float] = None
        self.bad_validations = 0

    def on_fit_start(self, view: TrainerView) -> None:
        if self._unsaid and view.rank == 0:
            log.info(inference_note(self.monitor, f"EarlyStopping(monitor={self.monitor!r})",
                                    'EarlyStopping(mode="{mode}")'))
        self._unsaid = False
        if self.restore_best:
            self._check_restored_best(view.config.get("trainer", {}))

    def _check_restored_best(self, trainer: Mapping[str, Any]) -> None:
        """restore_best restores trainer.save_best's checkpoint: it must watch the same metric in
        the same direction. The message names the fix on the side that is wrong."""
        save_best = trainer.get("save_best")
        intro = (f"EarlyStopping(monitor={self.monitor!r}, mode={self.mode!r}, restore_best=True)"
                 f" restores the checkpoint trainer.save_best keeps, but")
        if save_best != self.monitor:
            named = infer_mode(self.monitor)
            mode = "" if named and named[0] == self.mode else f" trainer.save_best_mode={self.mode}"
            raise ConfigError(f"{intro} trainer.save_best={save_best!r}. Set trainer.save_best="
                              f"{self.monitor}{mode}.")
        best_mode = metric_mode(save_best, trainer.get("save_best_mode"), "trainer.save_best",
                                "trainer.save_best_mode={mode}")
        if best_mode == self.mode:
            return
        named = infer_mode(self.monitor)  # the side the name disagrees with is wrong
        if named is None:
            fix = f'EarlyStopping(mode="{best_mode}") or trainer.save_best_mode={self.mode}'
        elif self.mode != named[0]:
            fix = f'EarlyStopping(mode="{named[0]}")'
        else:
            fix = f"trainer.save_best_mode={named[0]}"
        raise ConfigError(f"{intro} keeps the {'highest' if best_mode == 'max' else 'lowest'} "
                          f"{save_best} (trainer.save_best_mode={best_mode}). Set {fix}.")

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
        return {"best": self.best, "bad_validations": self.bad_validations, "mode": self.mode}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = state.get("mode", self.mode)  # a checkpoint of an earlier version: unknown
        if saved != self.mode and state["best"] is not None:  # its best is the other extreme
            raise ConfigError(
                f"EarlyStopping(monitor={self.monitor!r}): the checkpoint's best was tracked with "
                f'mode={saved!r}, this run uses mode={self.mode!r}. Pass EarlyStopping(mode='
                f'"{saved}") to continue it, or resume=fresh to start over.')
        self.best, self.bad_validations = state["best"], state["bad_validations"]
