"""A run's objective: which validation metric ranks the jobs of a sweep, and its best value during
the run (with the step), read from what the run records."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from ..errors import ConfigError


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
                 save_best_mode: str) -> Objective:
    """The objective of `sweep.metric`/`sweep.mode`, else of trainer.save_best, else val/loss (min).
    A metric other than those two needs its mode: a guessed direction would rank silently wrong."""
    if metric is None:
        metric = save_best or "val/loss"
    if mode is None:
        if metric == save_best:
            mode = save_best_mode
        elif metric == "val/loss":
            mode = "min"
        else:
            raise ConfigError(f"sweep.metric={metric} needs its direction: set sweep.mode=min or "
                              f"sweep.mode=max.")
    return Objective(metric, mode)


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
