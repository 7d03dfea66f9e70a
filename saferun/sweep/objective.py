"""A run's objective: which validation metric ranks the jobs of a sweep, and its best value during
the run (with the step), read from what the run records."""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from ..direction import inference_note, metric_mode

log = logging.getLogger("saferun")


@dataclass(frozen=True)
class Objective:
    """The metric a sweep ranks its jobs by, and which direction is better."""

    metric: str
    mode: str  # "min" or "max"

    def better(self, a: float, b: float) -> bool:
        """a is strictly better than b (a NaN is never better: its comparisons are false; any
        number beats a NaN)."""
        if math.isnan(b):
            return True
        return a < b if self.mode == "min" else a > b

    def result(self, run_dir: str, final: Mapping[str, float], step: int) -> Optional[dict[str, Any]]:
        """{"metric", "mode", "value", "step", "final"}: the best value during the run and its
        step, and the final value; None if the run never reported the metric."""
        best = best_during_run(run_dir, self)
        if best is None and self.metric in final:  # no metrics.jsonl: the final value is all there is
            best = (float(final[self.metric]), step)
        if best is None:
            return None
        return {"metric": self.metric, "mode": self.mode, "value": best[0], "step": best[1],
                "final": final.get(self.metric)}


def objective_of(metric: Optional[str], mode: Optional[str], save_best: Optional[str],
                 save_best_mode: Optional[str]) -> Objective:
    """The objective of `sweep.metric`/`sweep.mode`, else of trainer.save_best (in its mode),
    else val/loss. A mode not given is the one the metric's name says (said in the log); a
    name that says none is refused: a guessed direction would rank silently wrong."""
    given, metric = metric is not None, metric or save_best or "val/loss"
    if mode is None and metric == save_best:
        return Objective(metric, metric_mode(metric, save_best_mode, "trainer.save_best",
                                             "trainer.save_best_mode={mode}"))
    if mode is None:  # the name says it (the trainer says save_best's inference)
        mode = metric_mode(metric, None, "sweep.metric", "sweep.mode={mode}")
        if given:
            log.info(inference_note(metric, "sweep.metric", "sweep.mode={mode}"))
    return Objective(metric, metric_mode(metric, mode, "sweep.metric", "sweep.mode={mode}"))


def best_during_run(run_dir: str, objective: Objective) -> Optional[tuple[float, int]]:
    """(best value, step) of `objective.metric` over the run's validations, from its
    metrics.jsonl ("val" lines; a resume has cut the lines after its checkpoint, so each
    validation appears once); the first step reaching the best wins. None without any."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return None
    best: Optional[tuple[float, int]] = None
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):  # the line a crashed process was writing
                break
            record = json.loads(line)
            if record.get("kind") != "val" or objective.metric not in record:
                continue
            value = float(record[objective.metric])
            if best is None or objective.better(value, best[0]):
                best = (value, int(record["step"]))
    return best
