"""`saferun run -m hydra/sweeper=optuna ...`: the search space and the sweeper's keys checked
before Hydra starts, so that a mistake in them is named with its override (not an Optuna
traceback) and no sweep directory or optuna.db is made for a study that cannot run."""

from __future__ import annotations

import difflib
from importlib import resources
from typing import Any, Optional, Sequence


def search_space_problem(overrides: Sequence[str]) -> Optional[str]:
    """The first mistake in an Optuna sweep's overrides, with the fix; None if there is none
    (or the sweeper is not saferun's Optuna sweeper)."""
    if "hydra/sweeper=optuna" not in overrides:
        return None
    import yaml
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import IntervalSweep
    from hydra.errors import HydraException

    keys = set(yaml.safe_load(resources.files("saferun.conf").joinpath(
        "hydra/sweeper/optuna.yaml").read_text())) - {"_target_"}
    for arg in overrides:
        try:
            override = OverridesParser.create().parse_overrides([arg])[0]
        except HydraException:
            continue  # Hydra's own message names the override
        key = override.get_key_element().lstrip("+~")
        if key.startswith("hydra.sweeper.") and key.count(".") == 2 and key.split(".")[2] not in keys:
            close = difflib.get_close_matches(key.split(".")[2], sorted(keys), n=1, cutoff=0.6)
            hint = f" Did you mean hydra.sweeper.{close[0]}?" if close else ""
            return (f"unknown key '{key}' of the Optuna sweeper in '{arg}'.{hint} Its keys: "
                    f"{', '.join(sorted(keys))} (conf/hydra/sweeper/optuna.yaml).")
        if key == "hydra.sweeper.n_trials" and not override.is_sweep_override():
            value = override.value()
            if not isinstance(value, int) or value < 1:
                return (f"hydra.sweeper.n_trials={value}: a study runs at least one trial; "
                        f"give a whole number >= 1 (hydra.sweeper.n_trials=20).")
        sweep: Any = override.value() if override.is_sweep_override() else None
        if isinstance(sweep, IntervalSweep):
            start, end = float(sweep.start), float(sweep.end)  # type: ignore[arg-type]  # parsed bounds
            if start >= end:
                return (f"'{arg}': the interval's start {sweep.start} is not below its end "
                        f"{sweep.end}; write it lowest first: interval({sweep.end},{sweep.start})"
                        if start > end else f"'{arg}': the interval is empty ({sweep.start} to "
                        f"{sweep.end}); give two different bounds, or {key}={sweep.start}.")
            if "log" in sweep.tags and start <= 0:
                return (f"'{arg}': a log scale needs bounds above 0 (the start is {sweep.start}); "
                        f"start it at a small positive value, e.g. interval(1e-6,{sweep.end}).")
    return None


def grid_problem(overrides: Sequence[str], config_dirs: Sequence[str] = ()) -> Optional[str]:
    """A grid sweep (Hydra's basic sweeper): each value of each swept key composed (the other
    keys at their first value) and checked as its job would be, before any job starts. So one
    bad value (optim.lr=1e-3,-1) is refused with nothing run, rather than after the jobs
    before it, with no summary and a folder for the refused job."""
    if any(o.startswith("hydra/sweeper=") for o in overrides):
        return None
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from ..errors import SaferunError
    from .compose import compose_config

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException:
        return None  # Hydra's own message names the override
    first, values = [], []
    for o in parsed:
        if o.is_sweep_override() and o.is_discrete_sweep():
            options = list(o.sweep_string_iterator())
            first.append(f"{o.get_key_element()}={options[0]}")
            values.append(options)
        else:
            first.append(o.input_line or "")
            values.append([])
    if not any(values):
        return None
    for i, options in enumerate(values):
        for value in options:
            job = [*first[:i], f"{parsed[i].get_key_element()}={value}", *first[i + 1:]]
            try:
                compose_config(job, config_dirs)
            except (SaferunError, HydraException) as e:
                return (f"the sweep's job with {parsed[i].get_key_element()}={value} would be "
                        f"refused, so no job was started: {str(e).splitlines()[0]}")
    return None
