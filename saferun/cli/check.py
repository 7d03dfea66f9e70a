"""`saferun check`: a short diagnostic session with every guard on (see `saferun.check`)."""

from __future__ import annotations

import logging
import sys

from .compose import _config_dirs, compose_config, flags_first, kept_recipe_note

CHECK_FLAGS = {"-h": 0, "--help": 0, "-cd": 1, "--config-dir": 1}
USAGE = """usage: saferun check [-cd DIR] [OVERRIDES]
  a short diagnostic session of the config `saferun run OVERRIDES` would train with, every
  guard on: one line per check (ok, warn, FAIL), exit status 1 if any fails. -cd DIR: a
  project's configs and code (saferun new), as for saferun run.
"""


def check(args: list[str]) -> None:
    """`saferun check [overrides]`: compose the config as `run` would, run the diagnostics."""
    from ..check import exit_status, format_report, make_factory, run_checks
    from ..errors import SaferunError

    # The report is the output: saferun's INFO lines from the short runs would bury it.
    quiet = logging.StreamHandler(sys.stderr)
    quiet.setLevel(logging.WARNING)
    logging.getLogger("saferun").addHandler(quiet)
    args, problem = flags_first(args, "check", CHECK_FLAGS)
    if problem is not None:
        print(f"saferun check: error: {problem}", file=sys.stderr)
        raise SystemExit(2)
    if "-h" in args or "--help" in args:
        print(USAGE, end="")
        return
    dirs, overrides = _config_dirs(args)
    from ..config import Config
    from ..suggest import unknown_override

    problem = unknown_override(overrides, Config, dirs)
    if problem is not None:
        print(f"saferun check: error: {problem}", file=sys.stderr)
        raise SystemExit(2)
    note = kept_recipe_note(overrides)
    if note is not None:
        print(f"saferun check: warning: {note}", file=sys.stderr)
    try:
        config = compose_config(overrides, dirs)
        results = run_checks(make_factory(config.task), config)
    except SaferunError as e:
        print(f"saferun check: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(format_report(results))
    raise SystemExit(exit_status(results))
