"""`saferun run`: compose the config with Hydra and train (one process, a sweep, or one rank
of a torchrun job)."""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

from . import compose, rundirs
from .compose import _config_dirs, _register_with_hydra, flags_first, run_id
from ..sweep.cluster import prepare_multirun, in_job


def run(args: list[str]) -> None:
    """`saferun run [hydra args]`: compose the config with Hydra and train."""
    rundirs.note_args(args)  # first: whether the run directory exists before anything makes it
    intended = _intend_from_args(args)  # then at once, before torch is imported
    try:
        _run(args)
    except BaseException as e:
        if intended is not None and not _JOB_STARTED:  # refused before the job: nothing changed
            from ..checkpoint import intent

            intent.drop_intent(intended, True)
        if isinstance(e, SystemExit) and _several_ranks():  # saferun's errors are printed already
            _end_rank(e.code)
        raise
    if _several_ranks():
        _end_rank(0)


def _several_ranks() -> bool:
    return int(os.environ.get("WORLD_SIZE", 1)) > 1


def _main_rank() -> bool:
    """Rank 0 of a torchrun job, or a process alone (read from the environment: no torch)."""
    return os.environ.get("RANK", "0") == "0"


def _end_rank(code: Any) -> None:
    """A torchrun rank ends here, with `code` as SystemExit takes it (None: 0; a text: printed,
    then 1), and without interpreter teardown (`distributed.end_process`)."""
    from ..distributed import end_process

    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr, flush=True)
        code = 1
    end_process(code or 0)


def _run(args: list[str]) -> None:
    # (no torch before the job: a mistaken command line is refused in a third of a second)
    import hydra

    global _ARGS
    args, problem = flags_first(args, "run")
    if problem is not None:
        print(f"saferun: error: {problem}", file=sys.stderr)
        raise SystemExit(2)
    _ARGS = list(args)
    _register_with_hydra()
    _check_run_dir_arg(args)
    _check_override_keys(args)
    for config_dir in _config_dirs(args)[0]:
        # A copied recipe (saferun new) keeps its Python file next to its configs.
        sys.path.insert(0, os.path.abspath(config_dir))
    sys.path.insert(0, os.getcwd())
    task = _job
    if not {"-m", "--multirun", "-h", "--help", "--hydra-help", "--version"} & set(args):
        _check_composition(args)
    if "-m" in args or "--multirun" in args:
        _check_search_space(args)
        # every job (in this process, or started by a launcher) resolves the same sweep dir
        os.environ["SAFERUN_RUN_ID"] = run_id()
        prepare_multirun(args)
    if _several_ranks():
        args, task = _join_torchrun_job(args)
    global _WRITE_HYDRA_DIR
    # conf/config.yaml sets hydra.output_subdir to null: .hydra/ is written by _train once the
    # run is accepted, not before, unless the command line sets it (then Hydra writes it).
    _WRITE_HYDRA_DIR = not any("hydra.output_subdir=" in arg for arg in args)
    sys.argv = ["saferun"] + args
    try:
        hydra.main(version_base="1.3", config_path="pkg://saferun.conf", config_name="config")(task)()
    except BaseException:
        if "-m" in args or "--multirun" in args:
            compose.summarize_stopped_sweep(_RUNNING_JOB)
        raise


_WRITE_HYDRA_DIR = False  # saferun, not Hydra, writes <run dir>/.hydra/ (after acceptance)
_JOB_STARTED = False  # Hydra composed the config and started the job (_train)
_RUNNING_JOB: Optional[str] = None  # the multirun job _train runs now (its number), if any
_ARGS: list[str] = []  # the command line as given, for the commands an error suggests


def _intend_from_args(args: list[str]) -> Optional[str]:
    """resume=PATH with hydra.run.dir=DIR on the command line: the change of course is durable
    (checkpoint/intent.py) before anything heavy starts; return DIR (rank 0). A run directory
    Hydra makes up, or a resume set in a config file: `_train` writes it once Hydra has
    composed the config."""
    from ..checkpoint import intent

    given = {key.lstrip("+"): value for key, _, value in (a.partition("=") for a in args)}
    run_dir, resume = given.get("hydra.run.dir"), given.get("resume")
    main = _main_rank()
    if "-m" in args or "--multirun" in args or run_dir is None or "${" in run_dir + str(resume):
        return None
    try:
        return run_dir if intent.intend(run_dir, resume, main) and main else None
    except OSError:
        return None  # an unwritable run directory: _check_run_dir_arg says so, next



def _write_hydra_dir(run_dir: str, cfg: Any, hydra_cfg: Any) -> None:
    """Hydra's .hydra/config.yaml, hydra.yaml and overrides.yaml, as Hydra writes them."""
    from omegaconf import OmegaConf

    folder = Path(run_dir) / ".hydra"
    folder.mkdir(exist_ok=True)
    hydra = OmegaConf.create({"hydra": OmegaConf.to_container(hydra_cfg)})
    hydra.hydra.output_subdir = ".hydra"
    for name, node in (("config", cfg), ("hydra", hydra), ("overrides", hydra_cfg.overrides.task)):
        (folder / f"{name}.yaml").write_text(OmegaConf.to_yaml(node))


def _check_run_dir_arg(args: list[str]) -> None:
    """A `hydra.run.dir=` that cannot be a run directory: say so before Hydra fails on it."""
    from ..checkpoint.rundir import check_writable

    for arg in args:
        if arg.startswith("hydra.run.dir=") and "${" not in arg:
            problem = check_writable(Path(arg.split("=", 1)[1]))
            if problem is not None:
                print(f"saferun: error: {problem}", file=sys.stderr)
                raise SystemExit(1)


def _check_override_keys(args: list[str]) -> None:
    """A misspelt key: name the closest valid one before Hydra suggests '+key' (which the
    schema then refuses anyway)."""
    from ..config import Config
    from ..suggest import unknown_override
    from .compose import kept_recipe_note

    dirs, overrides = _config_dirs(args)
    problem = unknown_override(overrides, Config, dirs)
    if problem is not None:
        print(f"saferun: error: {problem}", file=sys.stderr)
        raise SystemExit(1)
    note = kept_recipe_note(overrides)
    if note is not None and _main_rank():
        print(f"saferun: warning: {note}", file=sys.stderr)


def _check_composition(args: list[str]) -> None:
    """What Hydra's composition refuses, in one line, before Hydra prints it as a traceback."""
    from .compose import compose_problem

    dirs, overrides = _config_dirs(args)
    overrides = [o for o in overrides if not o.startswith("-") and "=" in o]
    problem = compose_problem(overrides, dirs)
    if problem is not None:
        print(f"saferun: error: {problem}", file=sys.stderr)
        raise SystemExit(1)


def _check_search_space(args: list[str]) -> None:
    """An Optuna sweep's search space and sweeper keys, or each value of a grid sweep, checked
    before Hydra makes the sweep folder."""
    from .searchspace import grid_problem, search_space_problem

    dirs, overrides = _config_dirs(args)
    overrides = [o for o in overrides if not o.startswith("-")]
    problem = search_space_problem(overrides) or grid_problem(overrides, dirs)
    if problem is not None:
        print(f"saferun: error: {problem}", file=sys.stderr)
        raise SystemExit(1)


def _join_torchrun_job(args: list[str]) -> tuple[list[str], Any]:
    """Under torchrun: start the process group before Hydra, so that rank 0 picks the run
    id (hence one run directory) for every rank; only rank 0 keeps Hydra's files and logs."""
    import torch
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.errors import record

    from ..config import TrainerConfig
    from ..distributed import broadcast

    if "-m" in args or "--multirun" in args:
        print("saferun: error: a sweep (-m) cannot run under torchrun; launch one torchrun job "
              "per configuration.", file=sys.stderr)
        raise SystemExit(2)
    # Bounded from the start; the Trainer then applies the config's trainer.collective_timeout.
    timeout = datetime.timedelta(seconds=TrainerConfig.collective_timeout)
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo",
                            timeout=timeout)
    compose._RUN_ID = os.environ["SAFERUN_RUN_ID"] = broadcast(run_id())
    if dist.get_rank() != 0:
        args = args + ["hydra.output_subdir=null", "hydra/job_logging=disabled",
                       "hydra/hydra_logging=disabled"]
    # record: torchrun then reports the failing rank's traceback as the job's root cause.
    return args, record(_train)


def _job(cfg: Any) -> Optional[float]:
    """A job of `saferun run`: `_train`, inside a submitit job's processes when a launcher
    started it (`saferun.sweep.cluster`)."""
    return in_job(_train, cfg)


def _train(cfg: Any) -> Optional[float]:
    """One Hydra job: validate the config, build the recipe's Trainer, fit, write the summary;
    return the objective's best value during the run (what a sweeper optimizes)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import get_class
    from omegaconf import OmegaConf

    from ..checkpoint import intent

    global _JOB_STARTED
    _JOB_STARTED = True  # from here a refusal drops the intent (below), a crash leaves it
    # resume=PATH: durable before the model is built (a kill in that start-up leaves the
    # intent, which resume=auto carries out); rank 0 (torchrun) writes
    resume = OmegaConf.to_container(cfg, resolve=False).get("resume")  # type: ignore[union-attr]  # a job's config is a mapping
    intended = intent.intend(HydraConfig.get().runtime.output_dir,
                             resume if isinstance(resume, str) and "${" not in resume else None,
                             _main_rank())

    from ..checkpoint.rundir import update_summary, when_accepted
    from ..checkpoint.superseded import note_log_files
    from ..config import load_config
    from ..errors import SaferunError

    from ..distributed import broadcast, ranks_from_env
    from ..sweep.objective import objective_of

    note_log_files()  # before anything is logged: where this run's lines in saferun.log start
    hydra_cfg = HydraConfig.get()
    run_dir = hydra_cfg.runtime.output_dir
    global _RUNNING_JOB
    _RUNNING_JOB = str(hydra_cfg.job.num) if hydra_cfg.mode.name == "MULTIRUN" else None  # type: ignore[union-attr]  # set by Hydra
    main = ranks_from_env().is_main
    started = time.time()
    try:
        # Resolved once, on rank 0, for every rank (interpolations such as ${now:} could differ).
        plain = broadcast(compose.plain_config(cfg))
        rundirs.check_run_dir(plain["trainer"].get("run_dir"), plain.get("resume"), run_dir,
                              _ARGS, hydra_cfg.mode.name == "MULTIRUN")  # type: ignore[union-attr]  # set by Hydra
        plain["trainer"]["run_dir"] = run_dir
        config = load_config(plain)
        if config.task is None:
            raise SaferunError("no task: set task._target_ to a saferun.Trainer subclass "
                               "(recipes do; see `saferun list`).")
        task = dict(config.task)
        objective = objective_of(config.sweep.metric, config.sweep.mode, config.trainer.save_best,
                                 config.trainer.save_best_mode)
        task_class = get_class(task.pop("_target_"))
        if main:  # config.yaml: written by fit() once the run directory and resume are accepted
            print(f"saferun: run directory {run_dir}", flush=True)
            if _WRITE_HYDRA_DIR:  # and .hydra/ with it
                when_accepted(run_dir, lambda: _write_hydra_dir(run_dir, cfg, hydra_cfg))
        trainer = task_class(config, **task)
        metrics = trainer.fit()
    except SaferunError as e:
        print(f"saferun: error: {e}", file=sys.stderr, flush=True)
        if intended:  # refused: nothing changed, and nothing is left to carry out
            intent.drop_intent(run_dir, main)
        if main:
            rundirs.remove_if_refused(run_dir)
        raise SystemExit(1) from None
    _RUNNING_JOB = None  # it finished: a stop after this is not this job's
    if not main:
        return None
    summary = {
        "name": config.name,
        "run_dir": run_dir,
        "overrides": list(hydra_cfg.overrides.task),
        "step": trainer.state.step,
        "seconds": round(time.time() - started, 2),
        "metrics": metrics,
        "objective": objective.result(run_dir, metrics, trainer.state.step),
        "best": dataclasses.asdict(trainer.best) if trainer.best is not None else None,
    }
    update_summary(run_dir, summary)  # (what test() wrote there, e.g. from after_fit, stays)
    shown = ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if k.startswith(("val/", "train/loss")))
    print(f"saferun: done at step {trainer.state.step}: {shown}", flush=True)
    print(f"saferun: run directory {run_dir}", flush=True)
    return None if summary["objective"] is None else summary["objective"]["value"]
