"""Golden losses: the first N training losses of a job match a stored file."""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from ..callbacks import Callback
from .jobs import Job, fail, one_thread, work_dir
from .options import update_golden_requested


class _Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, view: Any, metrics: Mapping[str, float]) -> None:
        self.losses.append(metrics["train/loss"])


def first_losses(job: Job, steps: int = 5, tmp_dir: Any = None) -> list[float]:
    """train/loss at steps 1..`steps` of a fresh run of `job` (one torch thread)."""
    recorder = _Losses()
    with one_thread(), work_dir(tmp_dir, "saferun-golden-") as tmp:
        job.build(job.short(tmp, max_steps=steps, max_epochs=None, log_every_n_steps=1,
                            limit_val_batches=1), [recorder]).fit()
    return recorder.losses


def assert_golden_losses(job: Job, path: str | os.PathLike[str], steps: int = 5,
                         rtol: float = 1e-4, atol: float = 0.0, update: Optional[bool] = None,
                         tmp_dir: Any = None) -> None:
    """The first `steps` losses of `job` equal those stored in the JSON file `path`,
    within `rtol` (relative) and `atol`; the failure shows each step side by side.

    `update`: write (or refresh) the file instead of comparing; default: whether pytest
    was given `--saferun-update-golden`. The runs use one torch thread, so the losses do not
    depend on the machine's core count; they still depend on the torch release and the
    device (record them where the test runs, e.g. with `trainer.device=cpu`).
    """
    path = Path(path)
    losses = first_losses(job, steps, tmp_dir)
    if update is None:
        update = update_golden_requested()
    if update:
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"steps": steps, "losses": losses,
                  "recorded_with": {"torch": torch.__version__, "device": job.config.trainer.device,
                                    "threads": 1}}
        path.write_text(json.dumps(record, indent=1) + "\n")
        # shown in pytest's warnings summary: which files an update rewrote
        warnings.warn(f"saferun: wrote the golden losses of {job.name} to {path}", stacklevel=2)
        return
    if not path.exists():
        fail(f"no golden losses for {job.name} at {path}: record them with "
             f"`pytest --saferun-update-golden` (then commit the file).")
    golden = json.loads(path.read_text())
    want = golden["losses"]
    if len(want) != len(losses) or len(losses) != steps:
        fail(f"golden losses for {job.name}: {path} holds {len(want)} steps, the run logged "
             f"{len(losses)} of {steps}; refresh it with `pytest --saferun-update-golden`.")
    bad = [i for i, (g, w) in enumerate(zip(losses, want))
           if not (math.isfinite(g) and abs(g - w) <= atol + rtol * abs(w))]
    if bad:
        fail(_diff(job, path, losses, want, bad, rtol, atol, golden.get("recorded_with", {})))


def _diff(job: Job, path: Path, got: list[float], want: list[float], bad: list[int],
          rtol: float, atol: float, recorded: Mapping[str, Any]) -> str:
    lines = [f"golden losses of {job.name} drifted at step {bad[0] + 1} "
             f"({len(bad)} of {len(got)} steps beyond rtol={rtol:g}, atol={atol:g}; {path}):",
             f"  {'step':>4}  {'golden':>12}  {'now':>12}  {'rel diff':>9}"]
    for i, (g, w) in enumerate(zip(got, want)):
        rel = abs(g - w) / abs(w) if w else abs(g - w)
        lines.append(f"  {i + 1:>4}  {w:>12.7g}  {g:>12.7g}  {rel:>9.2e}" + ("  <--" if i in bad else ""))
    if recorded.get("torch") not in (None, torch.__version__):
        lines.append(f"The file was recorded with torch {recorded['torch']}; this is "
                     f"{torch.__version__}, whose kernels may round differently.")
    lines.append("If the change is intended (a new model, data or setting), refresh the file: "
                 "pytest --saferun-update-golden")
    return "\n".join(lines)
