"""The lifecycle grid: each stateful component (a row) through each event of a run's life (a
column). A cell says what the component must hold after the event:

- "equal": equal to the uninterrupted reference run, step by step (two ranks: within float
  rounding, the sums are split over two processes);
- "course": a new course, linked to the old one: the component holds what a run stopped at
  the course's checkpoint and resumed with the new setting holds, and nothing of the old
  course is lost (its logs, its tracker runs);
- "refused": the event ends in a SaferunError that says what is wrong; what the component
  holds up to the refusal equals the reference, and no checkpoint holds a non-finite value;
- "consistent": a bad step the policy handles: the component agrees with the run's own
  metrics.jsonl (which reports the bad step), and nothing non-finite is kept where the policy
  promises it is not.

A cell that fails today because of a known defect names it (issue 31 item N) as a strict
xfail: it fails the run once the defect is fixed, to be turned into a plain cell."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

ROWS = {  # row: what it is (the Trainer's part it covers)
    "metrics.jsonl": "saferun.loggers.MetricsJsonl",
    "tensorboard scalars": "saferun.loggers.TensorBoardLogger (scalars)",
    "tensorboard media": "saferun.loggers.TensorBoardLogger (images, texts, histograms)",
    "mlflow": "saferun.loggers.trackers.MLflowLogger (metrics, run status, model.pt)",
    "mlflow media": "saferun.loggers.trackers.MLflowLogger (images, texts, histograms)",
    "wandb": "saferun.loggers.trackers.WandbLogger (offline history)",
    "best": "model_best.pt, Trainer.best (trainer.save_best)",
    "early stopping": "saferun.stopping.EarlyStopping",
    "scheduler": "a length-dependent schedule (saferun.schedules.warmup_cosine)",
    "plateau": "torch's ReduceLROnPlateau (trainer.sched_metric)",
    "ema": "trainer.ema (model_ema.pt, the checkpoint's average)",
    "checkpoint": "the loop's own state: model, optimizer, scaler, step, data position",
    "spikes": "guards.spikes' detectors (each rank's window, count, limit and refresh count)",
    "optuna study": "hydra/sweeper=optuna's study (optuna.db)",
    "sweep summary": "the sweep's summary.txt and optimization_results.yaml",
}

# W&B offline after a SIGKILL: its service writes the transaction log in 32 KiB blocks (or every
# x_transaction_log_flush_interval seconds), and W&B has no flush a log point could call, so a
# killed process loses the rows W&B still buffered; the resumed run cannot send them again (it
# starts at the checkpoint, and W&B takes steps in order only). Its cells check that the resume
# says which steps W&B may lack, and that W&B equals the reference at every other step.
WANDB_KILLED = ("sigkill", "sigkill_in_validation")

# The events; a row's cell reads the run of its event (runs.py), the plateau row its variant.
EVENTS = ["reference", "sigkill", "sigkill_in_validation", "sigkill_before_checkpoint",
          "sigterm", "course_same_dir", "course_other_dir", "fresh", "second_fit", "two_ranks",
          "nonfinite_raise", "nonfinite_skip", "nonfinite_rollback", "nonfinite_off",
          "nonfinite_param", "nonfinite_param_rollback"]
SWEEP_EVENTS = ["sweep_uninterrupted", "sweep_continued"]
KIND = {"reference": "equal", "sigkill": "equal", "sigkill_in_validation": "equal",
        "sigkill_before_checkpoint": "equal", "sigterm": "equal", "course_same_dir": "course",
        "course_other_dir": "course", "fresh": "equal", "second_fit": "equal or refused",
        "two_ranks": "equal", "nonfinite_raise": "refused", "nonfinite_skip": "consistent",
        "nonfinite_rollback": "consistent", "nonfinite_off": "consistent",
        "nonfinite_param": "refused", "nonfinite_param_rollback": "consistent",
        "sweep_uninterrupted": "equal", "sweep_continued": "equal"}
RUN_ROWS = [r for r in ROWS if r not in ("optuna study", "sweep summary")]
PLATEAU_EVENTS = {"reference": "plateau_reference", "sigterm": "plateau_sigterm",
                  "second_fit": "plateau_second_fit"}  # the other events: the cosine row covers them


@dataclass(frozen=True)
class Known:
    """A cell that fails today: for item `item` of issue 31, or (None) a defect found here."""

    item: Optional[int]
    what: str


# Default cells: at least one per row and one per event; the rest are marked slow.
DEFAULT = {
    ("metrics.jsonl", e) for e in EVENTS} | {
    (r, "reference") for r in ROWS if r not in ("optuna study", "sweep summary")} | {
    ("mlflow", "sigkill_in_validation"), ("mlflow", "sigkill_before_checkpoint"),
    ("mlflow", "course_same_dir"), ("mlflow", "course_other_dir"), ("wandb", "fresh"), ("wandb", "sigkill"),
    ("scheduler", "second_fit"), ("plateau", "sigterm"), ("best", "nonfinite_raise"),
    ("checkpoint", "nonfinite_rollback"), ("mlflow", "nonfinite_rollback"), ("mlflow media", "nonfinite_rollback"),
    ("mlflow media", "course_same_dir"), ("checkpoint", "nonfinite_param"),
    ("checkpoint", "nonfinite_param_rollback"), ("ema", "two_ranks"), ("early stopping", "sigkill"),
    ("optuna study", "sweep_continued"), ("sweep summary", "sweep_continued"),
    ("spikes", "sigkill_in_validation"), ("spikes", "two_ranks"), ("spikes", "nonfinite_rollback")}

_MLFLOW_ROLLBACK = Known(None, "new defect (not in issue 31): after guards.nonfinite=rollback MLflow keeps "
                               "what the rollback undid (step 10 twice in its history, the abandoned "
                               "value first; its image too) while metrics.jsonl and TensorBoard cut it")
KNOWN: dict[tuple[str, str], Known] = {
}


def cells() -> list[tuple[str, str]]:
    """Every (row, event) the grid checks."""
    found = [(r, e) for r in RUN_ROWS for e in EVENTS if r != "plateau" or e in PLATEAU_EVENTS]
    return found + [(r, e) for r in ("optuna study", "sweep summary") for e in SWEEP_EVENTS]


def known(row: str, event: str) -> Optional[Known]:
    return KNOWN.get((row, event))
