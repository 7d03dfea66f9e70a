"""`saferun test RUN_DIR [checkpoint=best|last|PATH] [out_dir=DIR]`: a command-line run's model,
rebuilt from the run's config.yaml with the named weights, evaluated on the test split of its
datasets (`Trainer.from_run`, then `Trainer.test`)."""

from __future__ import annotations

import os
import sys

USAGE = ("usage: saferun test RUN_DIR [checkpoint=best|last|PATH] [out_dir=DIR]\n"
         "  checkpoint: best (model_best.pt, the default), last (model.pt), a checkpoint\n"
         "  directory or a .pt file; out_dir: where the test metrics are written (default: a\n"
         "  new directory under runs/; the run directory itself is not written)\n")


def test(args: list[str]) -> None:
    """`saferun test`: print the test metrics of a run's model; exit status 1 on a refusal."""
    from ..errors import SaferunError

    options: dict[str, str | None] = {"checkpoint": "best", "out_dir": None}
    for i, arg in enumerate(args):  # --checkpoint best, --out_dir=DIR: argparse's habit
        key = arg[2:].split("=", 1)[0].replace("-", "_")
        if arg.startswith("--") and key in options:
            value = arg.split("=", 1)[1] if "=" in arg else (args[i + 1] if i + 1 < len(args) else "VALUE")
            _usage_error(f"{arg.split('=', 1)[0]} is not an option: write {key}={value} "
                         f"(saferun test RUN_DIR {key}={value})")
    positional = [a for a in args if "=" not in a]
    for arg in (a for a in args if "=" in a):
        key, value = arg.split("=", 1)
        if key not in options:
            _usage_error(f"unknown argument {arg!r}")
        options[key] = value
    if len(positional) != 1 or positional[0] in ("-h", "--help"):
        if positional[:1] in (["-h"], ["--help"]):
            print(USAGE, end="")
            return
        _usage_error("name one run directory")
    try:
        metrics, out_dir = evaluate(positional[0], options["checkpoint"] or "best", options["out_dir"])
    except SaferunError as e:
        print(f"saferun test: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    for name, number in metrics.items():
        print(f"{name} {number:.6g}")
    print(f"saferun test: metrics written to {out_dir}", flush=True)


def evaluate(run_dir: str, checkpoint: str, out_dir: str | None) -> tuple[dict[str, float], str]:
    """The test metrics of `run_dir`'s model with `checkpoint`'s weights, and where they went."""
    from hydra.utils import get_class

    from ..checkpoint.weights import saved_config
    from ..errors import SaferunError

    task = dict(saved_config(run_dir).get("task") or {})
    if not task.get("_target_"):
        raise SaferunError(f"the config of {run_dir} names no task (task._target_): it is not a "
                           f"command-line run. From Python, use YourTrainer.from_run("
                           f"{run_dir!r}).test(test_set).")
    sys.path.insert(0, os.getcwd())  # a copied recipe (saferun new) next to where it runs
    trainer = get_class(task.pop("_target_")).from_run(  # type: ignore[attr-defined]  # a Trainer subclass
        run_dir, checkpoint, out_dir=out_dir, **task)
    return trainer.test(), trainer.state.run_dir


def _usage_error(problem: str) -> None:
    print(f"saferun test: error: {problem}.\n{USAGE}", end="", file=sys.stderr)
    raise SystemExit(2)
