"""House rules checked mechanically (style.md R1, R5, R7, R9)."""

import ast
import re
import inspect
from pathlib import Path

import pytest

import saferun
from saferun.cli import recipe_names

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "saferun"


def code_lines(func) -> int:
    """Lines of a function that hold code (no blank, comment-only or docstring lines)."""
    source = inspect.getsource(func)
    tree = ast.parse(source.lstrip() if source.startswith(" ") else source)
    body = tree.body[0].body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    lines = set()
    for node in body:
        for child in ast.walk(node):
            if hasattr(child, "lineno"):
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    text = inspect.getsource(func).splitlines()
    return sum(1 for i in lines if i - 1 < len(text) and not text[i - 1].strip().startswith("#"))


def test_the_loop_reads_in_one_screen():
    assert code_lines(saferun.Trainer.fit) <= 40
    assert code_lines(saferun.Trainer.train_step) <= 60


def test_small_constructor():
    assert len(inspect.signature(saferun.Trainer.__init__).parameters) - 1 <= 8


def test_only_the_config_and_cli_modules_see_omegaconf():
    users = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                   if "omegaconf" in p.read_text() and "import" in p.read_text())
    seen = [name for name in users if any(
        line.strip().startswith(("import omegaconf", "from omegaconf"))
        for line in (PACKAGE / name).read_text().splitlines())]
    # sweep/: saferun's Hydra sweeper and launcher glue, handed OmegaConf objects by Hydra
    assert {n for n in seen if not n.startswith(("cli/", "sweep/"))} <= {"config.py"}, seen


@pytest.mark.parametrize("recipe", recipe_names())
def test_a_recipe_is_one_copyable_file(recipe):
    source = (ROOT / "recipes" / f"{recipe}.py").read_text()
    config = (ROOT / "conf" / "recipe" / f"{recipe}.yaml").read_text()
    assert len(source.splitlines()) <= 300
    doc = ast.get_docstring(ast.parse(source)) or ""
    assert f"saferun run recipe={recipe}" in doc and "Expected" in doc
    assert f"# Launch: saferun run recipe={recipe}" in config
    # only saferun's public API: a copy must keep working when saferun's internals change
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            for name in names:
                assert name in ("saferun", "saferun.modes") or not name.startswith("saferun"), name
                assert not name.startswith("saferun.recipes"), name


# ---------------------------------------------------------------- the architecture (issue 12)

MODULES = sorted(PACKAGE.rglob("*.py"))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """saferun module -> the saferun modules it imports: every import statement, including
    those under TYPE_CHECKING and inside functions; `from pkg import name` counts as an import
    of the submodule pkg.name when that is a module, else of pkg."""
    names = {module_name(p): p for p in MODULES}
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in names else module
                           for a in node.names]
            else:
                continue
            edges.update(t for t in targets if t in names and t != name)
        graph[name] = edges
    return graph


def test_the_import_graph_sees_the_known_edges():
    graph = import_graph()
    assert "saferun.state" in graph["saferun.callbacks"]  # under TYPE_CHECKING
    assert "saferun.distributed" in graph["saferun.loop.metrics"]  # from .. import distributed
    assert "saferun.check" in graph["saferun.cli"] or any(
        "saferun.check" in graph[m] for m in graph if m.startswith("saferun.cli"))


def test_no_import_cycle_among_saferun_modules():
    graph = import_graph()
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(node):] + [node]))
        if node in done:
            return
        for nxt in sorted(graph[node]):
            visit(nxt, path + [node])
        done.add(node)

    for module in sorted(graph):
        visit(module, [])


def package_of(module: str) -> str:
    """A node of the package graph: a subpackage is one node (saferun.loop.steps -> loop), and so
    is each top-level module (saferun.trainer -> trainer): each has a job of its own. The root
    package's __init__ is no node: it only names the exports, imported on first use."""
    return module.split(".")[1]


def package_graph() -> dict[tuple[str, str], list[str]]:
    """(importing node, imported node) -> the module imports behind that edge. Every import
    counts: under TYPE_CHECKING and inside functions too (import_graph)."""
    edges: dict[tuple[str, str], list[str]] = {}
    for module, targets in import_graph().items():
        for target in sorted(targets):
            if "saferun" in (module, target) or package_of(module) == package_of(target):
                continue
            edges.setdefault((package_of(module), package_of(target)), []).append(f"{module} -> {target}")
    return edges


def test_the_package_graph_sees_the_known_edges():
    edges = package_graph()
    assert "saferun.check -> saferun.trainer" in edges["check", "trainer"]
    assert ("trainer", "guards") in edges and ("loop", "errors") in edges
    assert ("callbacks", "state") in edges  # under TYPE_CHECKING
    assert ("sweep", "config") in edges  # inside a function


def test_no_two_packages_import_each_other():
    """A reader finds each job in one folder and reads the packages one way: no two nodes of the
    package graph (package_of) import each other, through any of their modules."""
    edges = package_graph()
    both = {f"{a} <-> {b}": edges[a, b] + edges[b, a] for a, b in sorted(edges) if a < b and (b, a) in edges}
    assert not both, f"packages that import each other both ways (move the piece both use below them): {both}"


def test_every_error_class_is_in_errors_py():
    """One module holds the errors saferun raises (feature modules import it), so a reader finds
    them, and no package imports another for an exception class. Not errors, and left where they
    act: a private exception that never leaves its module (a loop's early exit), and the stop
    signals' StopRequested and Preempted (preemption.py)."""
    elsewhere = [f"{path.relative_to(PACKAGE)}: {node.name}" for path in MODULES if path.name != "errors.py"
                 for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)
                 and not node.name.startswith("_")
                 and any(ast.unparse(b).endswith("Error") for b in node.bases)]
    assert not elsewhere, f"error classes outside saferun/errors.py: {elsewhere}"


# Per-file line caps were retired: they pushed code into modules named for their size rather
# than their job. The function-length rules above (the loop reads in one screen) stay.


def _trainer_private_names() -> set[str]:
    """Private attribute and method names a set-up Trainer has (saferun's own classes)."""
    from toys import ToyTrainer, toy_config  # tests/ is on the path
    import tempfile

    trainer = ToyTrainer(toy_config(Path(tempfile.mkdtemp())))
    trainer.setup()
    names = set(vars(trainer)) | {n for c in type(trainer).__mro__
                                  if c.__module__.startswith("saferun") for n in vars(c)}
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _private_reads(root: Path, names: set[str], skip: Path | None = None) -> dict[str, list[str]]:
    """Reads or writes of the attributes `names` under `root`, other than self's and cls's
    (`getattr(trainer, "_manual", None)` reaches in as surely as `trainer._manual`)."""
    found: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        if path == skip:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr in names and not (
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))) or (
                    isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) > 1
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value in names):
                found.setdefault(str(path.relative_to(ROOT)), []).append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_part_reaches_further_into_the_trainers_private_state():
    found = _private_reads(PACKAGE, _trainer_private_names(), skip=PACKAGE / "trainer.py")
    # Each part gets what it needs passed in; none reaches into the Trainer's own state.
    assert not found, (f"reads or writes of Trainer private attributes outside trainer.py "
                       f"(pass what the part needs instead): {found}")


def test_no_test_reads_the_trainers_private_state():
    """Tests use the Trainer as users do (its public properties: scaler, ema, callbacks, best,
    state_dict()), so that they keep proving behaviour when its insides change."""
    allowed = {  # (file, attribute): why no public part will do
        ("tests/loop/test_compile.py", "_check_compile"):
            "the compile parity check run alone on a set-up Trainer, to see that it puts back the "
            "gradients, modes and RNG it found (fit() changes those around it)",
        ("tests/cuda/test_cuda.py", "_non_blocking"):
            "whether batches are copied to the GPU asynchronously (pinned memory): nothing public "
            "shows it",
    }
    found, used = {}, set()
    for file, reads in _private_reads(ROOT / "tests", _trainer_private_names()).items():
        for read in reads:
            name = read.rpartition(".")[2]
            if (file, name) in allowed:
                used.add((file, name))
            else:
                found.setdefault(file, []).append(read)
    assert not found, (f"tests that read or write Trainer private attributes (use a public "
                       f"property, or give the Trainer one): {found}")
    assert used == set(allowed), f"allowed but no longer read (remove them): {set(allowed) - used}"


def test_every_module_is_named_in_the_architecture_page():
    """docs/architecture.md's tree names every module of saferun/ (by file name; a name that
    several packages share, as `package/name.py` or in its package's paragraph)."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    tree = page[page.index("```\nsaferun/"):]
    tree = tree[:tree.index("\n```", 4)]
    blocks = re.split(r"\n  (?=\S)", tree)  # one per top-level entry: `loop/  ...`, `trainer.py ...`
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if path.name in ("__init__.py", "__main__.py"):
            continue
        where = [b for b in blocks if b.startswith(f"{rel.parent}/")] if rel.parent.parts else blocks
        if not any(re.search(rf"(?<![\w/]){re.escape(path.name)}", b) for b in where):
            missing.append(str(rel))
    assert not missing, f"modules the architecture page does not name: {missing}"


def test_a_config_is_checked_without_importing_torch():
    """The config nodes (trainer.ema, trainer.fsdp, trainer.parallel, sweep) live in config.py,
    not beside the code that reads them (which imports torch): a config error answers at once."""
    import subprocess
    import sys

    code = ("import sys; from saferun.config import load_config; from saferun.errors import ConfigError\n"
            "try:\n    load_config({'trainer': {'ema': {'decay': 2.0}}})\n"
            "except ConfigError as e:\n    print('refused:', e)\n"
            "print('torch imported:', 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "refused: trainer.ema.decay must be in (0, 1)" in out and "torch imported: False" in out, out
