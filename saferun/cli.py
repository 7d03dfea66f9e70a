"""The `saferun` command: `run` (Hydra), `new` (copy a recipe) and `list`.

This is the only module that sees Hydra's DictConfig: it composes the config,
turns it into a plain `saferun.Config` and hands that to the recipe's Trainer.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import secrets
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any, Optional, Sequence

USAGE = """usage: saferun COMMAND [ARGS]

commands:
  run [OVERRIDES]            train; overrides are Hydra's (recipe=charlm optim.lr=3e-3),
                             -m for sweeps, --help for the config groups, --cfg job, --info
  new DIR --from RECIPE      copy a recipe (its Python file and configs) into DIR to own it
  list                       the recipes and the options of every config group
  check [OVERRIDES]          a short diagnostic session with every guard on: one line per
                             check, exit status 1 if any fails (use it in your CI)
"""


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point of the `saferun` console command."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return
    command, rest = args[0], args[1:]
    commands = {"run": run, "new": new, "list": list_configs, "check": check}
    if command not in commands:
        print(f"saferun: unknown command {command!r}.\n\n{USAGE}", end="", file=sys.stderr)
        raise SystemExit(2)
    commands[command](rest)


# ---------------------------------------------------------------------- run


def run(args: list[str]) -> None:
    """`saferun run [hydra args]`: compose the config with Hydra and train."""
    import hydra

    from .parallel.distributed import ranks_from_env

    _register_with_hydra()
    _check_run_dir_arg(args)
    for config_dir in _config_dirs(args)[0]:
        # A copied recipe (saferun new) keeps its Python file next to its configs.
        sys.path.insert(0, os.path.abspath(config_dir))
    sys.path.insert(0, os.getcwd())
    task = _train
    if ranks_from_env().world_size > 1:
        args, task = _join_torchrun_job(args)
    sys.argv = ["saferun"] + args
    hydra.main(version_base="1.3", config_path="pkg://saferun.conf", config_name="config")(task)()
    if ranks_from_env().world_size > 1:
        import torch.distributed as dist

        dist.destroy_process_group()


def _check_run_dir_arg(args: list[str]) -> None:
    """A `hydra.run.dir=` that cannot be a run directory: say so before Hydra fails on it."""
    from .checkpoint.rundir import check_writable

    for arg in args:
        if arg.startswith("hydra.run.dir=") and "${" not in arg:
            problem = check_writable(Path(arg.split("=", 1)[1]))
            if problem is not None:
                print(f"saferun: error: {problem}", file=sys.stderr)
                raise SystemExit(1)


def _join_torchrun_job(args: list[str]) -> tuple[list[str], Any]:
    """Under torchrun: start the process group before Hydra, so that rank 0 picks the run
    id (hence one run directory) for every rank; only rank 0 keeps Hydra's files and logs."""
    import torch
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.errors import record

    from .config import TrainerConfig
    from .parallel.distributed import broadcast

    if "-m" in args or "--multirun" in args:
        print("saferun: error: a sweep (-m) cannot run under torchrun; launch one torchrun job "
              "per configuration.", file=sys.stderr)
        raise SystemExit(2)
    global _RUN_ID
    # Bounded from the start; the Trainer then applies the config's trainer.collective_timeout.
    timeout = datetime.timedelta(seconds=TrainerConfig.collective_timeout)
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo",
                            timeout=timeout)
    _RUN_ID = os.environ["SAFERUN_RUN_ID"] = broadcast(run_id())
    if dist.get_rank() != 0:
        args = args + ["hydra.output_subdir=null", "hydra/job_logging=disabled",
                       "hydra/hydra_logging=disabled"]
    # record: torchrun then reports the failing rank's traceback as the job's root cause.
    return args, record(_train)


def _train(cfg: Any) -> Optional[float]:
    """One Hydra job: validate the config, build the recipe's Trainer, fit, write the summary."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import get_class
    from omegaconf import OmegaConf

    from .config import load_config
    from .errors import SaferunError

    from .parallel.distributed import broadcast, ranks_from_env

    hydra_cfg = HydraConfig.get()
    run_dir = hydra_cfg.runtime.output_dir
    main = ranks_from_env().is_main
    started = time.time()
    try:
        # Resolved once, on rank 0, for every rank (interpolations such as ${now:} could differ).
        plain = broadcast(OmegaConf.to_container(cfg, resolve=True))
        plain["trainer"]["run_dir"] = run_dir
        config = load_config(plain)
        if config.task is None:
            raise SaferunError("no task: set task._target_ to a saferun.Trainer subclass "
                               "(recipes do; see `saferun list`).")
        task = dict(config.task)
        task_class = get_class(task.pop("_target_"))
        if main:  # config.yaml: written by fit() once the run directory and resume are accepted
            print(f"saferun: run directory {run_dir}", flush=True)
        trainer = task_class(config, **task)
        metrics = trainer.fit()
    except SaferunError as e:
        print(f"saferun: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    if not main:
        return None
    summary = {
        "name": config.name,
        "run_dir": run_dir,
        "overrides": list(hydra_cfg.overrides.task),
        "step": trainer.state.step,
        "seconds": round(time.time() - started, 2),
        "metrics": metrics,
    }
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    shown = ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if k.startswith(("val/", "train/loss")))
    print(f"saferun: done at step {trainer.state.step}: {shown}", flush=True)
    print(f"saferun: run directory {run_dir}", flush=True)
    return None


def compose_config(overrides: Sequence[str] = (), config_dirs: Sequence[str] = ()) -> Any:
    """The `saferun.Config` that `saferun run OVERRIDES` would train with (no run directory)."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from .config import load_config

    _register_with_hydra()
    overrides = list(overrides)
    for config_dir in config_dirs:
        sys.path.insert(0, os.path.abspath(config_dir))
    if config_dirs:
        paths = ",".join(f"file://{os.path.abspath(d)}" for d in config_dirs)
        overrides.append(f"hydra.searchpath=[{paths}]")
    with initialize_config_module(config_module="saferun.conf", version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    return load_config(OmegaConf.to_container(cfg, resolve=True))


def _register_with_hydra() -> None:
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from .config import Config

    ConfigStore.instance().store(name="saferun_schema", node=Config)
    if not OmegaConf.has_resolver("saferun_run_id"):
        OmegaConf.register_new_resolver("saferun_run_id", run_id, use_cache=True)


_RUN_ID: Optional[str] = None


def run_id() -> str:
    """The run's id: $SAFERUN_RUN_ID if set (so all ranks of a torchrun job agree), else
    a timestamp with a random suffix, fixed for the life of this process."""
    global _RUN_ID
    if _RUN_ID is None:
        _RUN_ID = os.environ.get("SAFERUN_RUN_ID") or (
            datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S") + "_" + secrets.token_hex(2))
    return _RUN_ID


def _config_dirs(args: list[str]) -> tuple[list[str], list[str]]:
    """Hydra's `-cd DIR` / `--config-dir DIR` / `--config-dir=DIR` arguments: (dirs, the rest)."""
    dirs, rest = [], []
    args_iter = iter(args)
    for arg in args_iter:
        if arg in ("-cd", "--config-dir"):
            dirs.append(next(args_iter, ""))
        elif arg.startswith("--config-dir="):
            dirs.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
    return [d for d in dirs if d], rest


try:
    from hydra.experimental.callback import Callback as _HydraCallback
except ImportError:  # pragma: no cover - hydra-core is a dependency
    _HydraCallback = object  # type: ignore[assignment,misc]


class SweepSummary(_HydraCallback):
    """After a multirun: one line per job with its overrides and final metrics."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        summaries = [json.loads(p.read_text()) for p in sweep_dir.glob("*/summary.json")]
        if not summaries:
            return
        summaries.sort(key=lambda s: int(Path(s["run_dir"]).name) if Path(s["run_dir"]).name.isdigit() else 0)
        keys = sorted({k for s in summaries for k in s["metrics"] if k.startswith(("val/", "train/loss"))})
        rows = [["job", "overrides", *keys]]
        for s in summaries:
            rows.append([Path(s["run_dir"]).name, " ".join(s["overrides"]) or "(none)",
                         *(f"{s['metrics'][k]:.4g}" if k in s["metrics"] else "-" for k in keys)])
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        table = "\n".join(lines)
        (sweep_dir / "summary.txt").write_text(table + "\n")
        print(f"\nsaferun: sweep summary ({sweep_dir / 'summary.txt'})\n{table}", flush=True)


# ---------------------------------------------------------------------- check


def check(args: list[str]) -> None:
    """`saferun check [overrides]`: compose the config as `run` would, run the diagnostics."""
    from .guards.check import exit_status, format_report, make_factory, run_checks
    from .errors import SaferunError

    # The report is the output: saferun's INFO lines from the short runs would bury it.
    quiet = logging.StreamHandler(sys.stderr)
    quiet.setLevel(logging.WARNING)
    logging.getLogger("saferun").addHandler(quiet)
    dirs, overrides = _config_dirs(args)
    try:
        config = compose_config(overrides, dirs)
        results = run_checks(make_factory(config.task), config)
    except SaferunError as e:
        print(f"saferun check: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(format_report(results))
    raise SystemExit(exit_status(results))


# ---------------------------------------------------------------------- new


def new(args: list[str]) -> None:
    """`saferun new DIR --from RECIPE [--name NAME]`: copy a recipe to own it."""
    import argparse

    parser = argparse.ArgumentParser(prog="saferun new", description=new.__doc__)
    parser.add_argument("dir", help="directory to create (must not exist or be empty)")
    parser.add_argument("--from", dest="recipe", required=True, help="a recipe from `saferun list`")
    parser.add_argument("--name", help="name of the copy (default: the directory's name)")
    opts = parser.parse_args(args)
    try:
        files = copy_recipe(opts.recipe, Path(opts.dir), opts.name)
    except ValueError as e:
        print(f"saferun new: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    name = files[0].stem
    print(f"saferun: copied recipe {opts.recipe!r} as {name!r}:")
    for f in files:
        print(f"  {f}")
    print(f"Run it:  cd {opts.dir} && saferun run -cd . recipe={name}")


def copy_recipe(recipe: str, dest: Path, name: Optional[str] = None) -> list[Path]:
    """Copy recipe `recipe` into `dest` under `name`; return the files written.

    The Python file is copied unchanged. Its configs (the recipe and the model
    and data options it selects) are copied with every `saferun.recipes.RECIPE`
    target pointing at the copy instead, so the copy never runs the original code.
    """
    shipped = recipe_names()
    if recipe not in shipped:
        raise ValueError(f"no recipe {recipe!r}; recipes: {', '.join(shipped)}.")
    name = name or re.sub(r"\W", "_", dest.resolve().name)
    if not name.isidentifier() or name in shipped:
        raise ValueError(f"{name!r} cannot name the copy: it must be a Python identifier and "
                         f"differ from the shipped recipes ({', '.join(shipped)}). Use --name.")
    if dest.exists() and any(dest.iterdir()):
        raise ValueError(f"{dest} exists and is not empty.")
    conf = resources.files("saferun.conf")
    recipe_yaml = conf.joinpath("recipe", f"{recipe}.yaml").read_text()
    module = f"saferun.recipes.{recipe}."
    written = [dest / f"{name}.py"]
    dest.mkdir(parents=True, exist_ok=True)
    written[0].write_text(resources.files("saferun.recipes").joinpath(f"{recipe}.py").read_text())
    for group, option in re.findall(r"override /(\w+): (\w+)", recipe_yaml):
        text = conf.joinpath(group, f"{option}.yaml").read_text()
        if module not in text:
            continue  # a generic option (optim: sgd, ...): the copy keeps selecting it
        path = dest / group / f"{name}.yaml"
        path.parent.mkdir(exist_ok=True)
        path.write_text(text.replace(module, f"{name}."))
        written.append(path)
        recipe_yaml = recipe_yaml.replace(f"override /{group}: {option}", f"override /{group}: {name}")
    recipe_yaml = recipe_yaml.replace(module, f"{name}.")
    recipe_yaml = re.sub(r"^name: .*$", f"name: {name}", recipe_yaml, flags=re.M)
    recipe_yaml = re.sub(r"^# Launch: .*$", f"# Launch (in this directory): saferun run -cd . recipe={name}",
                         recipe_yaml, flags=re.M)
    path = dest / "recipe" / f"{name}.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(recipe_yaml)
    written.append(path)
    return written


# ---------------------------------------------------------------------- list


def recipe_names() -> list[str]:
    """Recipes shipped with saferun: a Python file in saferun.recipes plus conf/recipe/NAME.yaml."""
    conf = resources.files("saferun.conf").joinpath("recipe")
    code = resources.files("saferun.recipes")
    return sorted(p.name[:-5] for p in conf.iterdir()
                  if p.name.endswith(".yaml") and code.joinpath(p.name[:-5] + ".py").is_file())


def list_configs(args: list[str]) -> None:
    """`saferun list`: recipes, then every config group's options, one line each."""
    conf = resources.files("saferun.conf")
    print("Recipes (saferun run recipe=NAME; copy one with saferun new DIR --from NAME):")
    for name in recipe_names():
        print(f"  {name:<16} {_description(conf.joinpath('recipe', name + '.yaml').read_text())}")
    print("\nConfig groups (saferun run GROUP=OPTION):")
    for group in sorted(p.name for p in conf.iterdir() if p.is_dir() and not p.name.startswith("_")):
        if group == "recipe":
            continue
        print(f"  {group}/")
        for option in sorted(p.name[:-5] for p in conf.joinpath(group).iterdir() if p.name.endswith(".yaml")):
            print(f"    {option:<14} {_description(conf.joinpath(group, option + '.yaml').read_text())}")


def _description(yaml_text: str) -> str:
    """The first comment line of a config file that is not a Hydra directive."""
    for line in yaml_text.splitlines():
        if line.startswith("#") and not line.startswith("# @package"):
            return line.lstrip("# ").strip()
        if line and not line.startswith("#"):
            break
    keys = [line.split(":")[0] for line in yaml_text.splitlines() if line and line[0].isalpha()]
    return "sets " + ", ".join(keys) if keys else ""
