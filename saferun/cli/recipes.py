"""`saferun new` (copy a recipe to own it) and `saferun list` (recipes and config options)."""

from __future__ import annotations

import re
import sys
from importlib import resources
from pathlib import Path
from typing import Optional


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
    print(f"Test it: cd {opts.dir} && pytest")


def copy_recipe(recipe: str, dest: Path, name: Optional[str] = None) -> list[Path]:
    """Copy recipe `recipe` into `dest` under `name`; return the files written.

    The Python file is copied unchanged. Its configs (the recipe and the model
    and data options it selects) are copied with every `saferun.recipes.RECIPE`
    target pointing at the copy instead, so the copy never runs the original code.
    Then tests/test_NAME.py (saferun.testing: check report, exact resume, golden
    losses, host syncs, determinism) and the recipe's golden losses.
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
    recipe_yaml = conf.joinpath("recipe").joinpath(f"{recipe}.yaml").read_text()
    module = f"saferun.recipes.{recipe}."
    written = [dest / f"{name}.py"]
    dest.mkdir(parents=True, exist_ok=True)
    written[0].write_text(resources.files("saferun.recipes").joinpath(f"{recipe}.py").read_text())
    for group, option in re.findall(r"override /(\w+): (\w+)", recipe_yaml):
        text = conf.joinpath(group).joinpath(f"{option}.yaml").read_text()
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
    from .project import write_project_tests

    return written + write_project_tests(dest, name, recipe)


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
        print(f"  {name:<16} {_description(conf.joinpath('recipe').joinpath(name + '.yaml').read_text())}")
    print("\nConfig groups (saferun run GROUP=OPTION):")
    for group in sorted(p.name for p in conf.iterdir() if p.is_dir() and not p.name.startswith("_")):
        if group in ("recipe", "hydra"):  # hydra/: Hydra's own groups, listed below
            continue
        print(f"  {group}/")
        for option in sorted(p.name[:-5] for p in conf.joinpath(group).iterdir() if p.name.endswith(".yaml")):
            print(f"    {option:<14} {_description(conf.joinpath(group).joinpath(option + '.yaml').read_text())}")
    print("\nSweeps (saferun run -m ...; docs/sweeps-and-clusters.md):\n"
          "  hydra/sweeper=optuna                          an Optuna study (pip install 'saferun[sweep]')\n"
          "  hydra/launcher=submitit_slurm|submitit_local  jobs on SLURM or local processes "
          "(pip install 'saferun[slurm]')")


def _description(yaml_text: str) -> str:
    """The first comment line of a config file that is not a Hydra directive."""
    for line in yaml_text.splitlines():
        if line.startswith("#") and not line.startswith("# @package"):
            return line.lstrip("# ").strip()
        if line and not line.startswith("#"):
            break
    keys = [line.split(":")[0] for line in yaml_text.splitlines() if line and line[0].isalpha()]
    return "sets " + ", ".join(keys) if keys else ""
