"""An Optuna study run as a Hydra sweep (`hydra/sweeper=optuna`, see the plugin in
`hydra_plugins.saferun_optuna`): each trial is one job of the launcher, in the sweep directory's
subdirectory named by the trial's number, and returns its objective's best value during the run.

A study kept in storage (SQLite in the sweep directory by default) continues when the sweep is
run again with the same `hydra.sweep.dir`: the finished trials count towards n_trials, and a
trial an interruption left running is run again in its own run directory with resume=auto,
from its newest checkpoint. The sampler continues its stream too (`continue_sampler`): rebuilt
with its fixed seed, it would draw the points of the first run again."""

from __future__ import annotations

import base64
import logging
import pickle
from pathlib import Path
from typing import Any, Literal, Sequence

from ..errors import ConfigError, SaferunError
from .objective import objective_of

log = logging.getLogger("saferun")
# A study user attribute: the sampler as the last run left it (pickled, base64), the trials
# it had drawn for by then, and the sampler's config (another config starts another stream).
SAMPLER_STATE = "saferun_sampler"


def search_space(arguments: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """({key: the sweep of an override}, the fixed overrides) of Hydra's override strings."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    space: dict[str, Any] = {}
    fixed: list[str] = []
    for override in OverridesParser.create().parse_overrides(list(arguments)):
        if override.is_sweep_override():
            space[override.get_key_element()] = override
        else:
            fixed.append(override.input_line)  # type: ignore[arg-type]  # set by the parser
    return space, fixed


def suggest(trial: Any, key: str, override: Any) -> str:
    """The trial's value for one key of the search space, as an override's value."""
    from hydra.core.override_parser.types import IntervalSweep, RangeSweep

    sweep = override.value()  # parsed from an override: its bounds are set (typed Optional)
    if isinstance(sweep, IntervalSweep):
        log = "log" in sweep.tags
        if "int" in sweep.tags:  # Hydra's interval is of floats: tag(int, interval(1,8))
            return str(trial.suggest_int(key, int(sweep.start), int(sweep.end), log=log))  # type: ignore[arg-type]  # bounds set
        return repr(trial.suggest_float(key, float(sweep.start), float(sweep.end), log=log))  # type: ignore[arg-type]  # bounds set
    if isinstance(sweep, RangeSweep) and all(isinstance(v, int) for v in (sweep.start, sweep.stop, sweep.step)):
        last = sweep.start + sweep.step * ((sweep.stop - sweep.start - 1) // sweep.step)  # type: ignore[operator]  # all ints (checked)
        return str(trial.suggest_int(key, sweep.start, last, step=sweep.step))
    return str(trial.suggest_categorical(key, list(override.sweep_string_iterator())))


def run_study(settings: dict[str, Any], config: Any, launcher: Any, arguments: Sequence[str]) -> Any:
    """Run the study's remaining trials; write optimization_results.yaml; return the study."""
    import optuna
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    space, fixed = search_space([*arguments, *(f"{k}={v}" for k, v in settings["params"].items())])
    if not space:
        raise ConfigError("hydra/sweeper=optuna: no search space. Give one as an override, e.g. "
                          "'optim.lr=tag(log,interval(1e-4,1e-2))' or 'optim=choice(adamw,sgd)'.")
    objective = objective_of(config.sweep.metric, config.sweep.mode, config.trainer.save_best,
                             config.trainer.save_best_mode)
    sweep_dir = Path(config.hydra.sweep.dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    direction: Literal["minimize", "maximize"] = "minimize" if objective.mode == "min" else "maximize"
    sampler = settings["sampler"]
    study = optuna.create_study(
        study_name=settings["study_name"], storage=settings["storage"], direction=direction,
        sampler=instantiate(sampler) if OmegaConf.is_config(sampler) else sampler, load_if_exists=True)
    continue_sampler(study, sampler)
    if study.direction.name.lower() != direction:
        raise ConfigError(f"the study {settings['study_name']!r} in {settings['storage']} was "
                          f"created to {study.direction.name.lower()}, but {objective.metric} "
                          f"({objective.mode}) needs {direction}: use another study_name or storage.")
    state = optuna.trial.TrialState
    reclaimed = study.get_trials(deepcopy=False, states=(state.RUNNING,))
    finished = len(study.get_trials(deepcopy=False, states=(state.COMPLETE, state.PRUNED, state.FAIL)))
    for frozen in reclaimed:  # left running by an interruption: continue it where it stopped
        params = [f"{key}={value}" for key, value in frozen.user_attrs["overrides"].items()]
        _launch(study, launcher, [(frozen.number, [*fixed, *params, "resume=auto"])], objective)
    while finished + len(reclaimed) < settings["n_trials"]:
        count = min(settings["n_jobs"], settings["n_trials"] - finished - len(reclaimed))
        batch = []
        for _ in range(count):
            trial = study.ask()
            values = {key: suggest(trial, key, override) for key, override in space.items()}
            trial.set_user_attr("overrides", values)
            batch.append((trial.number, [*fixed, *(f"{k}={v}" for k, v in values.items())]))
        save_sampler(study, sampler)  # before the trials run: a rerun draws on from here
        _launch(study, launcher, batch, objective)
        finished += count
    _write_results(study, sweep_dir, objective)
    return study


def _sampler_key(configured: Any) -> str:
    from omegaconf import OmegaConf

    if OmegaConf.is_config(configured):
        return OmegaConf.to_yaml(configured, resolve=True)
    return type(configured).__qualname__


def save_sampler(study: Any, configured: Any) -> None:
    """Keep the sampler's state in the study, beside the trials it drew (its storage)."""
    state = base64.b64encode(pickle.dumps(study.sampler)).decode("ascii")
    study.set_user_attr(SAMPLER_STATE, {"state": state, "trials": len(study.get_trials(deepcopy=False)),
                                        "config": _sampler_key(configured)})


def continue_sampler(study: Any, configured: Any) -> None:
    """A study that already has trials continues its sampler's stream: the state the last run
    saved, where the sampler's config is the same; else (another config, or a study without
    one) the configured sampler seeded from the study's state (its seed plus the trials so
    far), so that it does not draw the first run's points again."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    trials = len(study.get_trials(deepcopy=False))
    if not trials:
        return
    saved = study.user_attrs.get(SAMPLER_STATE)
    if saved and saved["config"] == _sampler_key(configured):
        study.sampler = pickle.loads(base64.b64decode(saved["state"]))
        if saved["trials"] != trials:  # killed between a draw and its save: at most that batch again
            log.warning("the Optuna sampler's saved state is of %d trials, the study has %d: "
                        "the next draws may repeat the last %d.", saved["trials"], trials,
                        trials - saved["trials"])
        log.info("Optuna: the study has %d trials; the sampler continues its stream.", trials)
        return
    seed = configured.get("seed") if OmegaConf.is_config(configured) else None
    if seed is not None:
        study.sampler = instantiate(configured, seed=int(seed) + trials)
    else:  # no seed in the config: draws are not repeatable anyway; an object: a new stream
        study.sampler.reseed_rng()
    log.info("Optuna: the study has %d trials but no sampler state saved for this sampler "
             "config; the sampler is seeded from the study (%s).", trials,
             f"seed {int(seed) + trials}" if seed is not None else "a new random seed")


def _launch(study: Any, launcher: Any, batch: list[tuple[int, list[str]]], objective: Any) -> None:
    """Run the batch's trials (one launch while their numbers follow each other: the launcher
    numbers the jobs, hence their directories, from the first) and tell the study the results."""
    from hydra.core.utils import JobStatus
    from optuna.trial import TrialState

    from ..preemption import Preempted

    numbers = [number for number, _ in batch]
    if numbers != list(range(numbers[0], numbers[0] + len(numbers))):
        for one in batch:
            _launch(study, launcher, [one], objective)
        return
    try:
        returns = launcher.launch([overrides for _, overrides in batch], initial_job_idx=numbers[0])
    except (Preempted, KeyboardInterrupt):
        raise  # the trials stay RUNNING: a rerun continues them
    except BaseException:
        for number in numbers:
            study.tell(number, state=TrialState.FAIL)
        raise
    for number, ret in zip(numbers, returns):
        if ret.status != JobStatus.COMPLETED:
            study.tell(number, state=TrialState.FAIL)
            raise SaferunError(f"trial {number} failed: {ret._return_value!r}")
        if ret.return_value is None:
            study.tell(number, state=TrialState.FAIL)
            raise SaferunError(f"trial {number} reported no {objective.metric}: its validation "
                               f"has none. Set sweep.metric (and sweep.mode) or trainer.save_best "
                               f"to a metric it reports.")
        study.tell(number, ret.return_value)


def _write_results(study: Any, sweep_dir: Path, objective: Any) -> None:
    """optimization_results.yaml: the best trial's number, overrides, value and run directory."""
    from omegaconf import OmegaConf

    best = study.best_trial
    results = {"name": "optuna", "metric": objective.metric, "mode": objective.mode,
               "best_trial": best.number, "best_params": _typed(best.user_attrs["overrides"]),
               "best_value": best.value, "best_run_dir": str((sweep_dir / str(best.number)).resolve())}
    (sweep_dir / "optimization_results.yaml").write_text(OmegaConf.to_yaml(results))


def _typed(overrides: dict[str, str]) -> dict[str, Any]:
    """{key: value} with each value as the command line reads it (0.003 a float, 32 an int,
    adamw a string), not the override's text."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in overrides.items()])
    return {o.get_key_element(): o.value() for o in parsed}
