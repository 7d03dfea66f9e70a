"""`saferun new` projects ship tests: they pass as generated (`cd DIR && pytest`) and fail, with
a clear message, when a typical bug is planted in the copy.

The planted-bug cases call the generated test functions in this process (they take no
fixtures): a pytest subprocess each would cost an interpreter start and the torch and
scikit-learn imports. The clean project runs as users run it, in a subprocess.
"""

import importlib.util

import pytest

from saferun.cli import copy_recipe
import helpers

Failed = pytest.fail.Exception


def pytest_in(project):
    """`cd project && pytest`, as a user runs it."""
    return helpers.pytest_in(project, timeout=900, env={"OMP_NUM_THREADS": "1"})


def test_a_new_project_ships_tests_that_pass_as_generated(tmp_path):
    copy_recipe("digits", tmp_path / "mydigits")
    assert (tmp_path / "mydigits" / "tests" / "golden" / "mydigits.json").is_file()
    proc = pytest_in(tmp_path / "mydigits")
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
    assert "5 passed" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tabular", "charlm"])
def test_the_other_recipes_projects_pass_as_generated(tmp_path, recipe):
    copy_recipe(recipe, tmp_path / f"my{recipe}")
    proc = pytest_in(tmp_path / f"my{recipe}")
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
    assert "5 passed" in proc.stdout


# Each plant: (name, text in the copy, its replacement, generated test, what the failure says).
SHIFT = "            dy, dx = random.randint(-1, 1), random.randint(-1, 1)\n"
PLANTS = {
    "item": ("        images, labels = batch\n        return F.cross_entropy(self.model(images), labels)\n",
             "        images, labels = batch\n        loss = F.cross_entropy(self.model(images), labels)\n"
             "        self.last_loss = loss.item()\n        return loss\n",
             "test_no_host_syncs_in_training_step",
             ["self.last_loss = loss.item()", "1.00/step", "[user]"]),
    "unseeded": (SHIFT, "            rng = __import__('numpy').random.default_rng()  # no seed\n"
                        "            dy, dx = (int(v) for v in rng.integers(-1, 2, size=2))\n",
                 "test_deterministic_and_workers_draw_differently",
                 ["FAIL  determinism", "different weights"]),
    "shared_rng": ("        self.augment = augment\n",
                   "        self.augment = augment\n        self.rng = random.Random(0)\n",
                   "test_deterministic_and_workers_draw_differently",
                   ["FAIL  worker seeding", "same random augmentation"]),
    "eval_state": ("    def forward(self, x: torch.Tensor) -> torch.Tensor:\n",
                   "    def forward(self, x: torch.Tensor) -> torch.Tensor:\n"
                   "        if not self.training:  # counts evaluation batches: changes in eval\n"
                   "            self.features[1].running_mean.add_(0.01)\n",
                   "test_saferun_check_passes",
                   ["FAIL  eval purity", "features.1.running_mean"]),
}


def plant(tmp_path, name):
    """A fresh copy of the digits recipe (its own module name) with bug `name` planted."""
    old, new, _, _ = PLANTS[name][:4]
    dest = tmp_path / f"planted_{name}"
    copy_recipe("digits", dest)
    source = dest / f"planted_{name}.py"
    text = source.read_text()
    assert old in text, name
    if name == "shared_rng":  # draw the shift from the generator copied into every worker
        text = text.replace(SHIFT, "            dy, dx = self.rng.randint(-1, 1), self.rng.randint(-1, 1)\n")
    source.write_text(text.replace(old, new, 1))
    return dest


def run_generated_test(project, test_name):
    path = next((project / "tests").glob("test_*.py"))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    getattr(module, test_name)()


def check_plant(tmp_path, name):
    test_name, expected = PLANTS[name][2], PLANTS[name][3]
    with pytest.raises(Failed) as e:
        run_generated_test(plant(tmp_path, name), test_name)
    for text in expected:
        assert text in str(e.value), (text, str(e.value))


def test_an_item_per_step_planted_in_the_copy_fails_naming_the_line(tmp_path):
    check_plant(tmp_path, "item")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["unseeded", "shared_rng", "eval_state"])
def test_planted_bugs_fail_with_a_clear_message(tmp_path, name):
    check_plant(tmp_path, name)


@pytest.mark.slow  # the generated check test: twelve checks (25 s)
def test_a_harmless_edit_passes_the_generated_check_test(tmp_path):
    """A Huber loss (small gradients) and another seed: the input baseline cannot conclude in
    its 16 steps; it says so (inconclusive) rather than warn that the inputs go unused."""
    project = tmp_path / "huber"
    copy_recipe("tabular", project)
    source = project / "huber.py"
    old = "        return F.mse_loss(self.model(features), targets)\n"
    assert old in source.read_text()
    source.write_text(source.read_text().replace(
        old, "        return F.huber_loss(self.model(features), targets, delta=0.1)\n", 1))
    recipe = project / "recipe" / "huber.yaml"
    recipe.write_text(recipe.read_text() + "seed: 1\n")
    run_generated_test(project, "test_saferun_check_passes")
