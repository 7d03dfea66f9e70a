"""A sweep's summary.txt: its jobs ranked by the objective, the best marked, each job's best value
during the run and its step beside the final value."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional


def sweep_summary(sweep_dir: Path) -> Optional[str]:
    """The table of the jobs under `sweep_dir` (from their summary.json), best first; None if
    no job left a summary. Jobs without one (failed, interrupted) are listed last."""
    jobs = sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()),
                  key=lambda p: int(p.name))
    summaries = {p.name: json.loads((p / "summary.json").read_text())
                 for p in jobs if (p / "summary.json").is_file()}
    if not summaries:
        return None
    objectives = {s["objective"]["metric"] + " " + s["objective"]["mode"]
                  for s in summaries.values() if s.get("objective")}
    ranked = _ranked(summaries) if len(objectives) == 1 else list(summaries)
    metric = next(iter(objectives)).split()[0] if len(objectives) == 1 else "objective"
    finals = sorted({k for s in summaries.values() for k in s["metrics"]
                     if k.startswith(("val/", "train/loss")) and k != metric})
    # the overrides every job shares go in the heading; each row shows what differs
    shared = [o for o in next(iter(summaries.values()))["overrides"]
              if all(o in s["overrides"] for s in summaries.values())] if len(summaries) > 1 else []
    rows = [["", "job", f"{metric} best", "at step", f"{metric} final", *finals, "overrides"]]
    for name in ranked:
        s = summaries[name]
        o = s.get("objective") or {}
        rows.append(["*" if name == ranked[0] and len(objectives) == 1 else "", name,
                     _num(o.get("value")), str(o.get("step", "-")), _num(o.get("final")),
                     *(_num(s["metrics"].get(k)) for k in finals),
                     " ".join(o for o in s["overrides"] if o not in shared) or "(none)"])
    for p in jobs:
        if p.name not in summaries:
            rows.append(["", p.name, "no summary.json: failed or interrupted", *[""] * (len(rows[0]) - 3)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    table = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    common = [f"every job: {' '.join(shared)}"] if shared else []
    return "\n".join([_heading(summaries, ranked, objectives), *common, *table])


def _ranked(summaries: dict[str, Any]) -> list[str]:
    """Job names, best objective first; jobs whose run never reported it (or NaN) last."""
    def key(name: str) -> tuple[int, float]:
        o = summaries[name].get("objective")
        if not o or o["value"] is None or math.isnan(o["value"]):
            return (1, 0.0)
        return (0, o["value"] if o["mode"] == "min" else -o["value"])
    return sorted(summaries, key=key)  # stable: ties keep the job order


def _heading(summaries: dict[str, Any], ranked: list[str], objectives: set[str]) -> str:
    if len(objectives) != 1:
        why = "the jobs rank by different metrics" if objectives else "no job reported its objective"
        return (f"{len(summaries)} jobs in job order ({why}; set sweep.metric and sweep.mode to "
                f"rank them).")
    best = summaries[ranked[0]]
    o = best["objective"]
    return (f"{len(summaries)} jobs ranked by {o['metric']} ({o['mode']}): its best value during "
            f"the run, the step of that value, and its final value; * marks the best job.\n"
            f"best: job {ranked[0]} ({' '.join(best['overrides']) or 'no overrides'}), "
            f"{o['metric']} {_num(o['value'])} at step {o['step']}, run directory "
            f"{best['run_dir']}")


def _num(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.4g}"
