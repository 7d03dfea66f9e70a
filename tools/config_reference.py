"""Write docs/config-reference.md from saferun's config dataclasses (their fields and docstrings).

    python tools/config_reference.py          # rewrite the page
    python tools/config_reference.py --check  # exit 1 if the page differs from the code

Every key gets its type, default, allowed values and meaning. The meaning is the docstring
written under the field; a field without one must be named in the next field's docstring
(`compile_rtol` shares `compile_atol`'s). Allowed values are read from the `__post_init__`
checks (`_positive`, `_positive_or_none`, `_one_of`) and, for the few checks written out by
hand, from EXTRA_ALLOWED. tests/unit/test_config_reference.py regenerates and compares.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import textwrap
from pathlib import Path
from typing import Any

from saferun import config

PAGE = Path(__file__).resolve().parents[1] / "docs" / "config-reference.md"

# Checks written out by hand in a __post_init__ (not through _positive/_one_of).
EXTRA_ALLOWED = {
    "trainer.num_workers": ">= 0",
    "trainer.multiprocessing_context": "fork, spawn, forkserver, null",
    "trainer.compile_rtol": ">= 0",
    "trainer.compile_atol": ">= 0",
    "trainer.save_best": "a validation metric (val/..., val_ema/... needs trainer.ema)",
    "trainer.sched_metric": "a validation metric (val/..., val_ema/... needs trainer.ema)",
    "trainer.ema.decay": "in (0, 1), or null",
    "trainer.fsdp.param_dtype": "bf16, fp32, null",
    "guards.nonfinite": ", ".join(config.NONFINITE_POLICIES),
    "guards.spikes": ", ".join(config.NONFINITE_POLICIES),
    "guards.max_consecutive": ">= 1",
    "guards.spike_threshold": "> 0",
    "guards.spike_warmup": "between 1 and guards.spike_window",
    "optim": "a node with `_target_` (required); `optim.lr` >= 0",
    "resume": "auto, fresh, a checkpoint's or run directory's path, null",
}
SECTIONS = [("trainer", config.TrainerConfig), ("trainer.ema", config.EmaConfig),
            ("trainer.fsdp", config.FSDPConfig), ("trainer.parallel", config.ParallelConfig),
            ("guards", config.GuardsConfig), ("sweep", config.SweepConfig),
            ("", config.Config)]


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, joined into one line."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(tree, ast.ClassDef)
    body = tree.body
    docs: dict[str, str] = {}
    for stmt, after in zip(body, body[1:]):
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(after, ast.Expr) \
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            docs[stmt.target.id] = " ".join(after.value.value.split())
    for stmt, after in zip(body, body[1:]):  # two fields in a row, one docstring for both
        if isinstance(stmt, ast.AnnAssign) and isinstance(after, ast.AnnAssign) \
                and isinstance(stmt.target, ast.Name) and isinstance(after.target, ast.Name) \
                and stmt.target.id not in docs and after.target.id in docs:
            docs[stmt.target.id] = docs[after.target.id]
    return docs


def checked_ranges(cls: type, prefix: str) -> dict[str, str]:
    """Allowed values from the `_positive`, `_positive_or_none` and `_one_of` calls."""
    post_init = getattr(cls, "__post_init__", None)
    if post_init is None:
        return {}
    ranges: dict[str, str] = {}
    for call in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(post_init)))):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
            continue
        args = [str(a.value) for a in call.args[1:] if isinstance(a, ast.Constant)]  # field names
        if call.func.id == "_positive":
            ranges.update({f"{prefix}.{a}": "> 0" for a in args})
        elif call.func.id == "_positive_or_none":
            ranges.update({f"{prefix}.{a}": "> 0, or null" for a in args})
        elif call.func.id == "_one_of":
            choices = call.args[2]
            values = (getattr(config, choices.id) if isinstance(choices, ast.Name)
                      else ast.literal_eval(choices))
            ranges[f"{prefix}.{args[0]}"] = ", ".join(values)
    return ranges


def default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc, operator]


def shown(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):
        return ", ".join(f"{k}: {shown(v) if not isinstance(v, dict) else v.get('_target_')}"
                         for k, v in value.items()) or "{}"
    return str(value)


def rows(prefix: str, cls: type) -> list[str]:
    docs = field_docs(cls)
    ranges = checked_ranges(cls, prefix or "trainer")
    out = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(default_of(f)):
            continue  # a section of its own
        if f.name not in docs:
            raise SystemExit(f"{cls.__name__}.{f.name} has no docstring: write one under the "
                             f"field in its dataclass, then rerun {Path(__file__).name}.")
        allowed = EXTRA_ALLOWED.get(key) or ranges.get(key, "")
        meaning = docs[f.name].replace("|", r"\|").replace("<", "&lt;")
        out.append(f"| `{key}` | `{f.type}` | `{shown(default_of(f))}` | {allowed} | {meaning} |")
    return out


def render() -> str:
    parts = ["# Configuration reference",
             "",
             "<!-- Generated by tools/config_reference.py from saferun/config.py's dataclasses; "
             "do not edit by hand: tests/unit/test_config_reference.py fails when "
             "this page and the code differ. -->",
             "",
             "Every key of `saferun.Config`, as a Python dict (`{\"trainer\": {\"max_steps\": 500}}`) "
             "or on the command line (`trainer.max_steps=500`). Unknown keys, wrong types and "
             "values outside the allowed ones are refused before any training, naming the key. "
             "`_target_` nodes (`optim`, `sched`, `model`, `data`, ...) take the keyword "
             "arguments of their target, checked against its signature.", ""]
    titles = {"trainer": "The loop (`trainer.`)", "trainer.ema": "Weight averaging (`trainer.ema.`)",
              "trainer.fsdp": "Sharding (`trainer.fsdp.`)",
              "trainer.parallel": "Device mesh (`trainer.parallel.`)", "guards": "Guards (`guards.`)",
              "sweep": "Sweeps (`sweep.`)",
              "": "The run (top-level keys)"}
    for prefix, cls in SECTIONS:
        parts += [f"## {titles[prefix]}", "", "| Key | Type | Default | Allowed | Meaning |",
                  "|---|---|---|---|---|", *rows(prefix, cls), ""]
    return "\n".join(parts)


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if PAGE.read_text() != text:
            print(f"{PAGE} differs from the code: run python tools/config_reference.py")
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
