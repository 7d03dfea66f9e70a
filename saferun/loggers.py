"""Built-in observers: TensorBoard event files, a progress bar and log lines.

All three are callbacks that act at log points only, where metrics are
already host floats, so none of them adds a host sync.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Mapping, Optional

from .callbacks import Callback, TrainerView

log = logging.getLogger("saferun")


class TensorBoardLogger(Callback):
    """Writes every logged metric, validation metric and the resolved config as TensorBoard events.

    After a resume, what the interrupted run wrote at or after the checkpoint's step is
    hidden (the writer's purge_step), and the scalars the checkpoint's step had when it was
    saved are written again (they are in this callback's checkpointed state): every step
    then holds what an uninterrupted run would show, once.
    """

    def __init__(self, log_dir: Optional[str] = None) -> None:
        self.log_dir = log_dir
        self._writer: Any = None
        self._resumed = False
        self._last_step = -1  # the latest step written, and the scalars written at it
        self._last_scalars: dict[str, float] = {}

    def on_fit_start(self, view: TrainerView) -> None:
        """Open the writer in `log_dir` (default: <run_dir>/tensorboard) and record the config."""
        from torch.utils.tensorboard import SummaryWriter
        import yaml

        resumed = self._resumed or view.step > 0
        # flush_secs: events reach the disk within 10 s (and at each checkpoint and the end)
        # without a flush per log point, which would cost the loop a file write every
        # log_every_n_steps steps.
        self._writer = SummaryWriter(self.log_dir or os.path.join(view.run_dir, "tensorboard"),
                                     flush_secs=10, purge_step=view.step if resumed else None)
        if resumed and self._last_step == view.step:
            self._write(view.step, dict(self._last_scalars))
        text = yaml.safe_dump(dict(view.config), sort_keys=False)
        # Markdown code block so TensorBoard keeps the indentation.
        self._writer.add_text("config", "    " + text.replace("\n", "\n    "), view.step)

    def on_log(self, view: TrainerView, metrics: Mapping[str, float]) -> None:
        self._write(view.step, metrics)

    def on_validation_end(self, view: TrainerView, metrics: Mapping[str, float]) -> None:
        self._write(view.step, metrics)

    def on_checkpoint(self, view: TrainerView, path: str) -> None:
        if self._writer is not None:
            self._writer.flush()  # a resume from this checkpoint finds every earlier event

    def on_fit_end(self, view: TrainerView, metrics: Mapping[str, float]) -> None:
        self.close()

    def on_exception(self, view: TrainerView, exc: BaseException) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        return {"step": self._last_step, "scalars": dict(self._last_scalars)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._resumed = True
        self._last_step = int(state.get("step", -1))
        self._last_scalars = dict(state.get("scalars", {}))

    def _write(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._writer is None:
            return
        if step != self._last_step:
            self._last_step, self._last_scalars = step, {}
        self._last_scalars.update(metrics)
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class ProgressBar(Callback):
    """A tqdm bar with step, loss and throughput, refreshed at log points only."""

    def __init__(self) -> None:
        self._bar: Any = None

    def on_fit_start(self, view: TrainerView) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(total=view.max_steps, initial=view.step, unit="step", dynamic_ncols=True)

    def on_log(self, view: TrainerView, metrics: Mapping[str, float]) -> None:
        if self._bar is None:
            return
        self._bar.update(view.step - self._bar.n)
        shown = {k.split("/", 1)[1]: f"{v:.4g}" for k, v in metrics.items()
                 if k in ("train/loss", "perf/samples_per_sec")}
        self._bar.set_postfix(shown, refresh=True)

    def on_validation_end(self, view: TrainerView, metrics: Mapping[str, float]) -> None:
        if self._bar is not None:
            self._bar.write(format_metrics(view, metrics))

    def on_fit_end(self, view: TrainerView, metrics: Mapping[str, float]) -> None:
        self.close()

    def on_exception(self, view: TrainerView, exc: BaseException) -> None:
        self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class LogLines(Callback):
    """One line per log point and per validation through the `saferun` logger."""

    def on_log(self, view: TrainerView, metrics: Mapping[str, float]) -> None:
        log.info(format_metrics(view, metrics))

    def on_validation_end(self, view: TrainerView, metrics: Mapping[str, float]) -> None:
        log.info(format_metrics(view, metrics))


def format_metrics(view: TrainerView, metrics: Mapping[str, float]) -> str:
    parts = [f"step {view.step}/{view.max_steps}", f"epoch {view.epoch}"]
    parts += [f"{k} {v:.4g}" for k, v in metrics.items()]
    return " | ".join(parts)


def want_progress_bar(setting: Optional[bool]) -> bool:
    """The bar is on when asked for, or (by default) when stderr is a terminal."""
    if setting is not None:
        return setting
    return sys.stderr.isatty() and not os.environ.get("CI")


def ensure_log_handler() -> None:
    """Show saferun's INFO lines in plain scripts, unless the application configured logging."""
    if log.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("[saferun] %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
