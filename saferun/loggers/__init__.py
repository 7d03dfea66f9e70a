"""The loggers: TensorBoard event files, metrics.jsonl, a progress bar and log lines here, the
experiment trackers (MLflow, W&B) in `trackers`.

All are callbacks that act at log points only, where metrics are
already host floats, so none of them adds a host sync.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import socket
import sys
import time
from typing import Any, Mapping, Optional, Sequence

from ..callbacks import Callback, Media, TrainerView
from .checksum import use_c_checksum

log = logging.getLogger("saferun")


_HPARAMS_SUFFIX = ".hparams"  # the event file of the HParams entry (TensorBoardLogger)


class TensorBoardLogger(Callback):
    """Writes every logged metric, validation metric and the resolved config as TensorBoard events,
    and at the end of training the run's hyperparameters (the flattened config) with its final
    metrics for the HParams view, where the jobs of a sweep compare in one table.

    After a resume, and after a rollback (guards.nonfinite=rollback) too, what was written at
    or after the checkpoint's step is hidden (the writer's purge_step), and the scalars the
    checkpoint's step had when it was saved are written again (they are in this callback's
    checkpointed state): every step then holds what an uninterrupted run would show, once.
    """

    def __init__(self, log_dir: Optional[str] = None) -> None:
        self.log_dir = log_dir
        self._writer: Any = None
        self._view: Optional[TrainerView] = None
        self._resumed = False
        self._last_step = -1  # the latest step written, and the scalars written at it
        self._last_scalars: dict[str, float] = {}
        self._last_media: list[Any] = []  # images, histograms, texts written at that step
        self._others: list[str] = []  # other runs' event files in a shared log_dir: kept

    def on_fit_start(self, view: TrainerView) -> None:
        """Open the writer in `log_dir` (default: <run_dir>/tensorboard) and record the config."""
        import yaml

        self._view = view
        self._open(self._resumed or view.step > 0)
        text = yaml.safe_dump(dict(view.config), sort_keys=False)
        # Markdown code block so TensorBoard keeps the indentation.
        self._writer.add_text("config", "    " + text.replace("\n", "\n    "), view.step)

    def _open(self, resumed: bool) -> None:
        from torch.utils.tensorboard import SummaryWriter

        use_c_checksum()  # (the writer thread's pure-Python checksum holds the GIL: ~0.16 ms an event)
        view = self._view
        assert view is not None
        # flush_secs: events reach the disk within 10 s (and at each checkpoint and the end)
        # without a flush per log point, which would cost the loop a file write every
        # log_every_n_steps steps.
        log_dir = self.log_dir or os.path.join(view.run_dir, "tensorboard")
        earlier = _event_files(log_dir) if resumed else set()
        if not resumed and _event_files(log_dir, hparams=True):  # (a run's own were set aside)
            self._others = sorted(_event_files(log_dir, hparams=True))
            log.warning("TensorBoard: %s already holds another run's event files (%s): "
                        "TensorBoard will show this run's curves merged with theirs, as one "
                        "run. Give each run its own directory (logger.tensorboard.log_dir; "
                        "the default is <run_dir>/tensorboard) and point TensorBoard at their "
                        "parent.", log_dir, ", ".join(self._others[:3]))
        # A fresh run's writer starts a session too (purge_step=0 writes its START event):
        # TensorBoard's server purges on a session's second START only, so without it a
        # resumed writer would hide nothing there (each step after the checkpoint shown twice).
        # Not in a directory holding other runs' files: their steps would be hidden.
        self._writer = SummaryWriter(log_dir, flush_secs=10, purge_step=view.step if resumed
                                     else None if self._others else 0)
        # this process's new file (another run sharing log_dir may add its own meanwhile)
        mine = {n for n in _event_files(log_dir) - earlier
                if f".{socket.gethostname()}.{os.getpid()}." in n}
        if earlier and mine and min(mine) < max(earlier):
            self._writer = _reopen_sorted_last(self._writer, log_dir, mine, max(earlier), view.step)
        if resumed and self._last_step == view.step:
            self._write(view.step, dict(self._last_scalars))
            self.on_media(view, list(self._last_media))

    def on_log(self, view: TrainerView, metrics: Mapping[str, float]) -> None:
        self._write(view.step, metrics)

    def on_validation_end(self, view: TrainerView, metrics: Mapping[str, float]) -> None:
        self._write(view.step, metrics)

    def on_media(self, view: TrainerView, media: Sequence[Media]) -> None:
        """log_image (CHW or HW, floats in [0, 1] or uint8), log_histogram, log_text."""
        if self._writer is None:
            return
        self._at(view.step)
        self._last_media += media
        for m in media:
            if m.kind == "image":
                self._writer.add_image(m.name, m.value, m.step,
                                       dataformats="HW" if m.value.ndim == 2 else "CHW")
            elif m.kind == "histogram":
                self._writer.add_histogram(m.name, m.value.float(), m.step)
            else:
                self._writer.add_text(m.name, m.value, m.step)

    def on_checkpoint(self, view: TrainerView, path: str) -> None:
        if self._writer is not None:
            self._writer.flush()  # a resume from this checkpoint finds every earlier event

    def on_test_end(self, view: TrainerView, metrics: Mapping[str, float]) -> None:
        """test()'s metrics at the trainer's step: through the open writer (test() inside fit,
        e.g. in after_fit), else a writer of their own that hides nothing written before."""
        if self._writer is not None:
            self._write(view.step, metrics)
            self._writer.flush()
            return
        from torch.utils.tensorboard import SummaryWriter

        log_dir = self.log_dir or os.path.join(view.run_dir, "tensorboard")
        earlier = _event_files(log_dir)
        writer = SummaryWriter(log_dir)
        mine = {n for n in _event_files(log_dir) - earlier
                if f".{socket.gethostname()}.{os.getpid()}." in n}
        if earlier and mine and min(mine) < max(earlier):  # read first, the fit's START would
            writer = _reopen_sorted_last(writer, log_dir, mine, max(earlier), view.step,  # hide it
                                         purge=False)
        for name, value in metrics.items():
            writer.add_scalar(name, value, view.step)
        writer.close()

    def on_fit_end(self, view: TrainerView, metrics: Mapping[str, float]) -> None:
        if self._writer is not None:
            self._write_hparams(view, metrics)
        self.close()

    def on_exception(self, view: TrainerView, exc: BaseException) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        return {"step": self._last_step, "scalars": dict(self._last_scalars),
                "media": [vars(m) for m in self._last_media], "others": list(self._others)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._resumed = True
        self._last_step = int(state.get("step", -1))
        self._last_scalars = dict(state.get("scalars", {}))
        self._last_media = [Media(**m) for m in state.get("media", [])]
        self._others = list(state.get("others", []))
        if self._writer is not None:  # a rollback mid-run: hide what came after the checkpoint
            self._writer.close()
            self._open(resumed=True)

    def _write_hparams(self, view: TrainerView, metrics: Mapping[str, float]) -> None:
        """The HParams view's entry: the config's values and the final metrics' names (their
        values are the scalars already written under those tags). TensorBoard takes an entry
        from the first event file of the directory that holds one (a purge does not hide it),
        so it goes into a file of its own, which the end of a resumed run replaces: a
        finished run continued with a larger max_steps shows the config it ended with."""
        from torch.utils.tensorboard.summary import hparams
        from torch.utils.tensorboard.writer import FileWriter

        log_dir = self._writer.get_logdir()
        for earlier in glob.glob(os.path.join(glob.escape(log_dir), "*" + _HPARAMS_SUFFIX)):
            if os.path.basename(earlier) not in self._others:  # another run's entry stays
                os.remove(earlier)
        writer = FileWriter(log_dir, filename_suffix=_HPARAMS_SUFFIX)
        finals = {k: v for k, v in metrics.items() if not k.startswith("perf/")}
        for summary in hparams(hparam_values(view.config), finals):
            writer.add_summary(summary, view.step)
        writer.close()

    def _write(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._writer is None:
            return
        self._at(step)
        self._last_scalars.update(metrics)
        from tensorboard.compat.proto.summary_pb2 import Summary

        # One event holding every scalar of the log point, as add_scalar writes each (a
        # simple_value): one entry in the writer's queue instead of one per metric, whose
        # bounded queue (10) otherwise makes a log point wait for the writer thread.
        self._writer.file_writer.add_summary(Summary(value=[
            Summary.Value(tag=name, simple_value=float(value)) for name, value in metrics.items()]),
            step)

    def _at(self, step: int) -> None:
        if step != self._last_step:
            self._last_step, self._last_scalars, self._last_media = step, {}, []

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


_EVENT_FILE = re.compile(r"events\.out\.tfevents\.(\d+)\.")


def _event_files(log_dir: str, hparams: bool = False) -> set[str]:
    """The names of the scalar event files in `log_dir` (and the HParams entries' too)."""
    if not os.path.isdir(log_dir):
        return set()
    return {n for n in os.listdir(log_dir)
            if _EVENT_FILE.match(n) and (hparams or not n.endswith(_HPARAMS_SUFFIX))}


def _reopen_sorted_last(writer: Any, log_dir: str, mine: set[str], latest: str, step: int,
                        purge: bool = True) -> Any:
    """TensorBoard reads a directory's event files in name order, and a purge hides only the
    steps read before it, so a resumed writer's file must sort after every earlier one. The
    name starts with the second the file was opened; one opened within the same second as an
    earlier writer can sort first (pid 1000 < 999, counter .10 < .9) and the earlier run's
    steps would then show twice. Drop that file, wait for the next second, open again (`purge`
    False: a test() writer, which hides nothing, whose steps a later file's START would hide)."""
    from torch.utils.tensorboard import SummaryWriter

    writer.close()
    for name in mine:
        os.remove(os.path.join(log_dir, name))
    match = _EVENT_FILE.match(latest)
    assert match is not None
    wait = int(match.group(1)) + 1 - time.time()
    if wait > 5:  # written by a machine whose clock runs ahead: waiting would not end soon
        log.warning("The TensorBoard event file %s is dated %.0f s in the future (another "
                    "machine's clock?): TensorBoard may show steps after %d twice for this run.",
                    latest, wait, step)
    else:
        time.sleep(max(wait, 0.0))
    return SummaryWriter(log_dir, flush_secs=10, purge_step=step if purge else None)


def hparam_values(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """The config flattened to dotted keys with the values TensorBoard's HParams accepts
    (numbers, strings, booleans; null and lists as text)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            flat.update(hparam_values(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value if isinstance(value, (bool, int, float, str)) \
                else str(value) if value is not None else "null"
    return flat


class MetricsJsonl(Callback):
    """<run_dir>/metrics.jsonl (or `path`): one JSON object per line, per log point ("kind":
    "train") and per validation ("kind": "val"), with step, epoch and time (Unix seconds), for
    scripts and notebooks (`pandas.read_json(path, lines=True)`).

    Written at log points only, on rank 0, each line flushed: a crashed process loses at most
    the line it was writing. The file's length is checkpointed: after a resume or a rollback
    the lines written after the checkpoint are cut off, so each step appears once.
    """

    def __init__(self, path: Optional[str] = None) -> None:
        self.path = path
        self._file: Any = None
        self._length: Optional[int] = None  # bytes when the checkpoint was saved (a resume)

    def on_fit_start(self, view: TrainerView) -> None:
        self.path = self.path or os.path.join(view.run_dir, "metrics.jsonl")
        self._open()

    def _open(self) -> None:
        assert self.path is not None
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        if self._length is not None and os.path.exists(self.path) and \
                os.path.getsize(self.path) > self._length:
            os.truncate(self.path, self._length)
        self._file = open(self.path, "a", encoding="utf-8")

    def on_log(self, view: TrainerView, metrics: Mapping[str, float]) -> None:
        self._write("train", view, metrics)

    def on_validation_end(self, view: TrainerView, metrics: Mapping[str, float]) -> None:
        self._write("val", view, metrics)

    def on_test_end(self, view: TrainerView, metrics: Mapping[str, float]) -> None:
        """A "test" line, appended (test() outside fit: to the file as fit left it)."""
        if self._file is not None:
            self._write("test", view, metrics)
            return
        path = self.path or os.path.join(view.run_dir, "metrics.jsonl")
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(self._line("test", view, metrics))

    def _write(self, kind: str, view: TrainerView, metrics: Mapping[str, float]) -> None:
        if self._file is not None:
            self._file.write(self._line(kind, view, metrics))
            self._file.flush()

    @staticmethod
    def _line(kind: str, view: TrainerView, metrics: Mapping[str, float]) -> str:
        record = {"kind": kind, "step": view.step, "epoch": view.epoch, "time": time.time()}
        return json.dumps({**record, **metrics}) + "\n"

    def state_dict(self) -> dict[str, Any]:
        return {"length": self._file.tell() if self._file is not None else self._length}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._length = state.get("length")
        if self._file is not None:  # a rollback mid-run: cut what came after the checkpoint
            self._file.close()
            self._open()

    def on_fit_end(self, view: TrainerView, metrics: Mapping[str, float]) -> None:
        self.close()

    def on_exception(self, view: TrainerView, exc: BaseException) -> None:
        self.close()

    def close(self) -> None:
        if self._file is not None:
            self._length = self._file.tell()
            self._file.close()
            self._file = None


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

    def on_test_end(self, view: TrainerView, metrics: Mapping[str, float]) -> None:
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
