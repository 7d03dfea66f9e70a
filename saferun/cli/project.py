"""The test file `saferun new` writes into a project, and what each shipped recipe's tests need.

Kept here, not in the cli, so that saferun's own recipe tests (tests/recipes/) run the same
jobs and read the same golden files as the projects copied from them.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

# Per recipe: overrides that make every test run small (steps are set by each helper), and
# the overrides the golden losses are recorded with (a 1-step warm-up, so that the first
# updates are large enough for rtol 1e-4 to see a change in how they are applied).
TEST_OVERRIDES: dict[str, list[str]] = {
    "digits": ["trainer.device=cpu"],
    "tabular": ["trainer.device=cpu"],
    "charlm": ["trainer.device=cpu", "task.sample_chars=0", "trainer.batch_size=16",
               "data.samples_per_epoch=128", "data.max_chars=40000"],
    # one pass of latent codes: an epoch of 22 steps, so that the resume test crosses one
    "gan": ["trainer.device=cpu", "task.sample_digits=0", "data.repeats=1"],
}
GOLDEN_OVERRIDES: dict[str, list[str]] = {
    "digits": [],
    "tabular": ["sched.warmup_steps=1"],
    # a fixed corpus: the default one is this Python's standard library, which changes
    # between CPython releases; {corpus} is the path of corpus_text() written to a file
    "charlm": ["sched.warmup_steps=1", "data.files=['{corpus}']"],
    "gan": ["optim.lr=2e-3"],  # train/loss: the sum of the discriminator's and generator's
}


def corpus_text() -> str:
    """The charlm recipe's fixed test corpus (90 KB of generated Python)."""
    return "".join(f"def f{i}(x, y={i % 7}):\n    return x * {i} + y  # {i:04x}\n\n"
                   for i in range(3000))


def golden_file(recipe: str) -> Path:
    """The golden losses shipped with recipe `recipe` (recipes/golden/RECIPE.json)."""
    return Path(str(resources.files("saferun.recipes").joinpath("golden").joinpath(f"{recipe}.json")))


TEMPLATE = '''"""Tests of {name}, written by `saferun new --from {recipe}`: run `pytest` in this directory.

Each test trains the recipe for a few steps in a temporary directory (one torch thread) with
saferun.testing, and fails with a message that says what is wrong and where:

- the `saferun check` report (pickling, worker seeding, eval purity, declared modes, unused
  parameters, host syncs, one-batch overfit, determinism, data overlap, initial loss, batch
  independence, input baseline) passes;
- a run stopped by SIGTERM mid-epoch, at an epoch's end and during validation, then
  resumed, ends bitwise equal to an uninterrupted run;
- the first 5 training losses match tests/golden/{name}.json (after an intended change:
  `pytest --saferun-update-golden`, then commit the file);
- training_step never reads a tensor's value into Python (`.item()`, `float(t)`, `if t:`);
- two runs with one seed give identical weights, and DataLoader workers draw different
  augmentations.

The knobs of each helper are in saferun's docs ("Test your training code", docs/testing.md).
"""

from pathlib import Path

from saferun import testing

PROJECT = Path(__file__).resolve().parents[1]
GOLDEN = PROJECT / "tests" / "golden" / "{name}.json"
OVERRIDES = {overrides}  # every test run: small and on the CPU
GOLDEN_OVERRIDES = {golden_overrides}


def job(*overrides):
    """The recipe as `saferun run -cd . recipe={name}` composes it, plus overrides."""
    return testing.recipe("{name}", *OVERRIDES, *overrides, config_dir=PROJECT)


def test_saferun_check_passes():
{check_body}

def test_resumes_exactly_after_a_stop():
    testing.assert_resumes_exactly(job())


def test_first_losses_match_the_golden_file():
{golden_body}

def test_no_host_syncs_in_training_step():
    testing.assert_no_host_syncs(job())


def test_deterministic_and_workers_draw_differently():
    testing.assert_deterministic(job(), num_workers=2)
'''


CHECK_BODY = "    testing.assert_checks_pass(job(), warn_ok=[])\n"
CHECK_BODY_CORPUS = """\
    # on the fixed text: the standard library repeats itself (licence headers, boilerplate),
    # so which validation windows equal training ones would depend on the Python installed
    corpus = PROJECT / "tests" / "golden" / "corpus.txt"
    testing.assert_checks_pass(job(f"data.files=['{corpus}']"), warn_ok=[])
"""
GOLDEN_BODY = "    testing.assert_golden_losses(job(*GOLDEN_OVERRIDES), GOLDEN)\n"
GOLDEN_BODY_CORPUS = """\
    corpus = PROJECT / "tests" / "golden" / "corpus.txt"  # a fixed text, not the standard library
    overrides = [o.replace("{corpus}", str(corpus)) for o in GOLDEN_OVERRIDES]
    testing.assert_golden_losses(job(*overrides), GOLDEN)
"""


def _python_list(items: list[str]) -> str:
    if len(repr(items)) <= 60:
        return repr(items)
    return "[\n" + "".join(f"    {item!r},\n" for item in items) + "]"


def write_project_tests(dest: Path, name: str, recipe: str) -> list[Path]:
    """Write DEST/tests/test_NAME.py and its golden losses (copied from the recipe's);
    return the files written."""
    tests = dest / "tests"
    (tests / "golden").mkdir(parents=True, exist_ok=True)
    test_file = tests / f"test_{name}.py"
    golden_overrides = GOLDEN_OVERRIDES.get(recipe, [])
    uses_corpus = any("{corpus}" in o for o in golden_overrides)
    test_file.write_text(TEMPLATE.format(
        name=name, recipe=recipe,
        overrides=_python_list(TEST_OVERRIDES.get(recipe, ["trainer.device=cpu"])),
        golden_overrides=_python_list(golden_overrides),
        golden_body=GOLDEN_BODY_CORPUS if uses_corpus else GOLDEN_BODY,
        check_body=CHECK_BODY_CORPUS if uses_corpus else CHECK_BODY))
    written = [test_file]
    golden = golden_file(recipe)
    if golden.is_file():
        target = tests / "golden" / f"{name}.json"
        target.write_text(golden.read_text())
        written.append(target)
    if uses_corpus:
        corpus = tests / "golden" / "corpus.txt"
        corpus.write_text(corpus_text())
        written.append(corpus)
    return written
