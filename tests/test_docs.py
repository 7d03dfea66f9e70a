"""The examples in README.md and docs/ run as written.

Every ```python block is run, a page's blocks in order in one namespace (so a page may build
on its earlier blocks), each page in a fresh namespace and a temporary working directory of its
own (all pages in one interpreter, so that torch is imported once), unless the line right before
its fence is `<!-- not run: <reason> -->`. Every ```bash block
of the README says how its commands are checked: `<!-- not run: <reason> -->`, or
`<!-- run by: <paths> -->` naming the files (tests, CI) that run them; the `saferun run`
lines of the command-line block are composed here as the command line would. Every `saferun`
command line of every page is composed too (short of training), and every dotted saferun
name a page writes resolves after `import saferun`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SLOW_PAGES = {"docs/how-to/resume-after-a-crash.md"}  # runs the command line twice
NOT_RUN = re.compile(r"<!-- not run: \S.* -->")
RUN_BY = re.compile(r"<!-- run by: (.+) -->")


def blocks(page: Path, language: str) -> list[tuple[int, str, str]]:
    """(line of the fence, the line before it, code) for each ```language block of a page."""
    lines = page.read_text().split("\n")
    found, i = [], 0
    while i < len(lines):
        if lines[i].strip() == f"```{language}":
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            found.append((i + 1, lines[i - 1] if i else "", "\n".join(lines[i + 1:end])))
            i = end
        i += 1
    return found


def name(page: Path) -> str:
    return str(page.relative_to(ROOT))


RUNNER = """
import json, os, sys, tempfile, traceback
failed = []
for page, blocks in json.load(open(sys.argv[1])):
    os.chdir(tempfile.mkdtemp(dir=sys.argv[2]))  # each page in a directory of its own
    namespace = {"__name__": "__main__"}  # and a namespace of its own
    for line, code in blocks:
        try:
            exec(compile(code, f"{page}:{line}", "exec"), namespace)
        except BaseException:
            failed.append(f"{page}:{line}: the block failed\\n{traceback.format_exc()}")
            break
print("\\n".join(failed), file=sys.stderr)
sys.exit(1 if failed else 0)
"""


def run_pages(pages: list[Path], tmp_path: Path) -> None:
    """Run each page's blocks in one interpreter (torch is imported once), each page in a
    fresh namespace and working directory."""
    work = [(name(p), [(line, code) for line, before, code in blocks(p, "python")
                       if not NOT_RUN.search(before)]) for p in pages]
    (tmp_path / "pages.json").write_text(json.dumps([w for w in work if w[1]]))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", RUNNER, "pages.json", str(tmp_path)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-8000:]


def test_the_python_blocks_of_every_page_run(tmp_path):
    run_pages([p for p in PAGES if name(p) not in SLOW_PAGES], tmp_path)


@pytest.mark.slow
def test_the_python_blocks_of_the_heavier_pages_run(tmp_path):
    run_pages([p for p in PAGES if name(p) in SLOW_PAGES], tmp_path)


def test_every_block_marked_not_run_gives_a_reason_and_every_readme_command_is_accounted_for():
    for page in PAGES:
        for line, before, _ in blocks(page, "python"):
            assert "not run" not in before or NOT_RUN.search(before), \
                f"{name(page)}:{line}: write `<!-- not run: <reason> -->` right before the fence"
    for line, before, _ in blocks(ROOT / "README.md", "bash"):
        assert NOT_RUN.search(before) or RUN_BY.search(before), \
            f"README.md:{line}: a command block needs `<!-- run by: ... -->` or `<!-- not run: ... -->`"
        if RUN_BY.search(before):
            for path in re.findall(r"(?:tests|\.ci)/[\w./]+\w", RUN_BY.search(before).group(1)):
                assert (ROOT / path).exists(), f"README.md:{line}: {path} (named as running it) is missing"


def test_the_readme_command_lines_compose():
    """Each `saferun run` line of the README composes into a valid config (a typo fails)."""
    from saferun.cli import compose_config

    lines = [code for _, before, code in blocks(ROOT / "README.md", "bash") if "composes" in before]
    assert lines, "the README's command-line block is not marked as composed here"
    commands = [cmd.split("#")[0].split() for cmd in lines[0].splitlines() if cmd.startswith("saferun run")]
    assert len(commands) >= 5
    for words in commands:
        overrides = [w.split(",")[0] for w in words[2:] if "=" in w and not w.startswith("hydra.")]
        assert compose_config(overrides) is not None, words


def test_every_torch_behaviour_on_the_pytorch_page_names_a_test_that_exists():
    page = (ROOT / "docs" / "pytorch.md").read_text()
    named = set(re.findall(r"`(test_\w+)`", page))
    source = (ROOT / "tests" / "unit" / "test_torch_behaviour.py").read_text()
    defined = set(re.findall(r"^def (test_\w+)", source, flags=re.M))
    assert len(named) >= 10 and named <= defined, sorted(named - defined)
    assert defined <= named, f"tests not cited on docs/pytorch.md: {sorted(defined - named)}"
    for path in re.findall(r"`(tests/[\w/]+\.py)`", page):
        assert (ROOT / path).exists(), path


def test_nothing_in_the_repository_points_outside_it():
    """The project documents what it relies on in its own words: no path to a sibling folder."""
    outside = [".." + "/shared", "/work/" + "shared", "shared/" + "pitfalls", "pitfalls" + ".md",
               "design" + "-review", "anchors" + ".md"]  # split: not found here
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert tracked
    for path in tracked:
        if path.endswith((".md", ".toml", ".py", ".yaml", ".yml", ".cfg", ".txt")) or path.startswith(".ci/"):
            text = (ROOT / path).read_text(errors="replace")
            assert not any(o in text for o in outside), path


FILE_NAMES = {"saferun.log", "saferun.lock",  # files a run writes, not Python names
              # tags the MLflow logger writes on a run (docs/logging.md)
              "saferun.previous_run_id", "saferun.resumed_step", "saferun.resumed_from",
              "saferun.rolled_back_from", "saferun.rolled_back_to_step"}
RESOLVE = """
import functools, importlib, json, sys
failed = []
for dotted in json.load(open(sys.argv[1])):
    for module in [m for m in sys.modules if m == "saferun" or m.startswith("saferun.")]:
        del sys.modules[module]  # each name after a bare `import saferun`, as a reader writes it
    saferun = importlib.import_module("saferun")
    try:
        functools.reduce(getattr, dotted.split(".")[1:], saferun)
    except Exception as e:
        failed.append(f"{dotted}: {type(e).__name__}: {e}")
print("\\n".join(failed), file=sys.stderr)
sys.exit(1 if failed else 0)
"""


def test_every_dotted_saferun_name_in_the_docs_works_after_import_saferun(tmp_path):
    """`saferun.stopping.EarlyStopping` as a page writes it: after `import saferun`, no other
    import (torch stays loaded between names, saferun is imported afresh for each)."""
    names = set()
    for page in PAGES:
        names |= set(re.findall(r"(?<![\w./-])saferun(?:\.[A-Za-z_]\w*)+", page.read_text()))
    names = sorted(n for n in names - FILE_NAMES if not n.endswith("."))
    assert "saferun.stopping.EarlyStopping" in names and len(names) > 20
    (tmp_path / "names.json").write_text(json.dumps(names))
    proc = subprocess.run([sys.executable, "-c", RESOLVE, "names.json"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]


TEMPLATE = re.compile(r"^[A-Z_]+$|=[A-Z_|]+$|^\[|\.\.\.")  # RUN_DIR, recipe=NAME, [overrides]


def command_lines(page: Path) -> list[tuple[int, str]]:
    """(line, command) for each `saferun COMMAND ...` of a page: the lines of its code blocks
    (continued with a backslash, comments cut; and their `cd DIR`) and its inline
    `saferun run ...` code."""
    lines, found, fenced, i = page.read_text().split("\n"), [], False, 0
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith("```"):
            fenced = not fenced
        elif fenced and line.startswith(("saferun ", "cd ")):
            start = i
            while line.endswith("\\"):
                i += 1
                line = line[:-1] + " " + lines[i].strip()
            found.append((start + 1, line.split(" #")[0]))
        elif not fenced:
            found += [(i + 1, m) for m in re.findall(r"`(saferun (?:run|check|test|new|list)(?=[\s`])[^`]*)`", line)]
        i += 1
    return found


def compose_command(words: list[str]) -> None:
    """What `saferun run|check WORDS` composes, without training: Hydra's flags set aside, a
    sweep's values replaced by its first (an interval by its lower end), the key check of the
    command line first."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from saferun.cli import compose_config
    from saferun.config import Config
    from saferun.suggest import unknown_override

    dirs, overrides, rest = [], [], iter(words)
    for word in rest:
        if word in ("-cd", "--config-dir"):
            dirs.append(next(rest))
        elif word == "--cfg":
            next(rest)
        elif word.startswith("-"):
            assert word in ("-m", "--multirun", "--help", "--hydra-help"), word
        else:
            overrides.append(word)
    assert unknown_override(overrides, Config, dirs) is None, unknown_override(overrides, Config, dirs)
    single = []
    for override in OverridesParser.create().parse_overrides(overrides):
        if not override.is_sweep_override():
            value = override.get_value_element_as_str()
        elif override.is_interval_sweep():
            value = str(override.value().start)  # type: ignore[union-attr]
        else:
            value = next(override.sweep_string_iterator())
        single.append(f"{override.get_key_element()}={value}")
    assert compose_config(single, dirs) is not None


def test_every_saferun_command_line_in_the_docs_composes(tmp_path, monkeypatch):
    """Each `saferun` command a page shows works as written, short of training: `run` and
    `check` compose (a misspelt key or a value the schema refuses fails here), `test` names one
    run directory and known options, `new` a shipped recipe (and is then made, for the page's
    `-cd` commands). Templates (RUN_DIR, recipe=NAME) are left out."""
    from saferun.cli import copy_recipe, recipe_names

    # the user's own module that the pages' examples name (mypkg.MyLogger)
    (tmp_path / "mypkg.py").write_text("import saferun\nclass MyLogger(saferun.Callback):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    counted = 0
    for page in PAGES:
        (tmp_path / name(page).replace("/", "_")).mkdir()
        monkeypatch.chdir(tmp_path / name(page).replace("/", "_"))  # `new` then `run -cd .`
        for line, command in command_lines(page):
            words = shlex.split(command)[1:]
            if command.startswith("cd "):
                monkeypatch.chdir(words[0])
                continue
            if any(TEMPLATE.search(w) for w in words) or words in (["test"], ["new"]):
                continue  # a template, or the command named in a sentence
            where = f"{name(page)}:{line}: {command}"
            try:
                if words[0] in ("run", "check"):
                    compose_command(words[1:])
                elif words[:2] in (["test", "--help"], ["new", "--help"]):
                    pass
                elif words[0] == "test":
                    run_dir = [w for w in words[1:] if "=" not in w]
                    assert len(run_dir) == 1 and not run_dir[0].startswith("-"), words
                    assert {w.split("=")[0] for w in words[1:] if "=" in w} <= {"checkpoint", "out_dir"}
                elif words[0] == "new":
                    if len(words) > 1:
                        assert words[2] == "--from" and words[3] in recipe_names(), words
                        if not Path(words[1]).exists():
                            copy_recipe(words[3], Path(words[1]))
                else:
                    assert words == ["list"], words
            except Exception as e:
                raise AssertionError(f"{where}\n{type(e).__name__}: {e}") from None
            counted += 1
    assert counted > 50


def test_the_troubleshooting_page_lists_every_message_saferun_raises():
    """Each SaferunError (ConfigError, CheckpointError, NonFiniteError) raised in saferun/ whose
    message starts with fixed words is on docs/how-to/troubleshooting.md by those words (its
    first 30 characters, up to the first variable part)."""
    import ast

    page = (ROOT / "docs" / "how-to" / "troubleshooting.md").read_text()
    errors = {"SaferunError", "ConfigError", "CheckpointError", "NonFiniteError"}
    missing, seen = [], 0
    for path in sorted((ROOT / "saferun").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and node.args and
                    getattr(node.func, "id", getattr(node.func, "attr", "")) in errors):
                continue
            message = node.args[0]
            first = message.values[0] if isinstance(message, ast.JoinedStr) and message.values else message
            words = first.value.split("{")[0].strip() if isinstance(first, ast.Constant) and \
                isinstance(first.value, str) else ""
            if len(words) >= 8:  # (a message that starts with a key's name is listed by its pattern)
                seen += 1
                if words[:30] not in page:
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno}: {words[:30]!r}")
    assert seen > 100 and not missing, "\n".join(missing)
