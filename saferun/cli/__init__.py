"""The `saferun` command: `run` (Hydra), `new` (copy a recipe), `list` and `check`, one module
per command (`run`, `recipes`, `check`) plus `compose` (the config as `run` composes it) and
`project` (the test file `new` writes).

The cli package and `saferun.config` are the only modules that see Hydra's DictConfig: the cli
composes the config, turns it into a plain `saferun.Config` and hands that to the recipe's Trainer.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from ..loop.threads import prepare_openmp
from .check import check
from .evaluate import test
from .compose import SweepSummary, _register_with_hydra, compose_config, run_id
from .recipes import copy_recipe, list_configs, new, recipe_names
from .run import run

__all__ = ["SweepSummary", "check", "compose_config", "copy_recipe", "list_configs", "main", "new",
           "recipe_names", "run", "run_id", "test", "_register_with_hydra"]

USAGE = """usage: saferun COMMAND [ARGS]

commands:
  run [OVERRIDES]            train; overrides are Hydra's (recipe=charlm optim.lr=3e-3),
                             -m for sweeps, --help for the config groups, --cfg job, --info
  new DIR --from RECIPE      copy a recipe (its Python file and configs) into DIR to own it
  list                       the recipes and the options of every config group
  check [OVERRIDES]          a short diagnostic session with every guard on: one line per
                             check, exit status 1 if any fails (use it in your CI)
  test RUN_DIR [checkpoint=best|last|PATH]
                             evaluate a run's model on the test split of its datasets
"""


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point of the `saferun` console command."""
    prepare_openmp()  # before anything imports torch: OpenMP reads its wait policy at load
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return
    command, rest = args[0], args[1:]
    commands = {"run": run, "new": new, "list": list_configs, "check": check, "test": test}
    if command not in commands:
        print(f"saferun: unknown command {command!r}.\n\n{USAGE}", end="", file=sys.stderr)
        raise SystemExit(2)
    commands[command](rest)
