"""`saferun check`: each diagnostic, on a clean recipe and with a planted bug."""

import os
import subprocess
import sys

import pytest
import torch

from saferun.check import format_report, run_checks
from saferun.config import load_config
from test_guards import BNAlwaysTrains, GeneratorOnDataset, LambdaTransformTrainer
from toys import ToyTrainer, toy_config


def results(cls, tmp_path, **kw):
    cfg = load_config(toy_config(tmp_path, **kw))
    return {r.name: r for r in run_checks(lambda c: cls(c), cfg)}


def test_a_clean_trainer_passes_every_check(tmp_path):
    found = results(ToyTrainer, tmp_path)
    assert set(found) == {"pickling", "worker seeding", "eval purity", "declared modes",
                          "unused parameters", "host syncs", "one-batch overfit", "determinism",
                          "data overlap", "initial loss", "batch independence", "input baseline",
                          "eval determinism", "batch order"}
    assert all(r.status == "pass" for r in found.values()), found


def test_planted_bugs_are_reported(tmp_path):
    class Everything(ToyTrainer):
        def build_model(self):
            torch.manual_seed(torch.seed())  # unseeded initialisation: runs differ
            model = BNAlwaysTrains()  # validation updates BatchNorm statistics
            return model

        def build_datasets(self):
            return GeneratorOnDataset(), GeneratorOnDataset()  # workers repeat draws

        def training_step(self, batch):
            loss = super().training_step(batch)
            self.last = loss.item()  # a host sync every step
            return loss

    found = results(Everything, tmp_path)
    assert found["worker seeding"].status == "fail"
    assert found["eval purity"].status == "fail" and "running_mean" in found["eval purity"].finding
    assert found["host syncs"].status == "warn" and "loss.item()" in found["host syncs"].finding
    assert found["determinism"].status == "fail"
    assert found["pickling"].status == "warn" and "dataset.rng" in found["pickling"].finding


def test_spawn_with_a_lambda_fails_pickling(tmp_path):
    found = results(LambdaTransformTrainer, tmp_path, num_workers=2, multiprocessing_context="spawn")
    assert found["pickling"].status == "fail"
    assert "dataset.transform.transforms[1]: a lambda" in found["pickling"].finding


def test_a_model_that_ignores_its_input_fails_to_overfit(tmp_path):
    class Constant(ToyTrainer):
        def training_step(self, batch):
            _, y = batch
            return super().training_step(batch) * 0 + torch.nn.functional.cross_entropy(
                torch.zeros(len(y), 3, requires_grad=True), y)

    assert results(Constant, tmp_path)["one-batch overfit"].status == "warn"


BAD_RECIPE = '''
import torch.nn.functional as F
import saferun
from torch import nn


class ForcesTrainBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(),
                                 nn.Linear(32, 10))

    def forward(self, x):
        self.net[2].train()  # the planted bug
        return self.net(x)


class BadTrainer(saferun.Trainer):
    def training_step(self, batch):
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def validation_step(self, batch):
        x, y = batch
        return {"loss": F.cross_entropy(self.model(x), y)}
'''


def test_the_command_exits_non_zero_on_a_failure(tmp_path):
    project = tmp_path / "project"
    (project / "recipe").mkdir(parents=True)
    (project / "badrecipe.py").write_text(BAD_RECIPE)
    (project / "recipe" / "badrecipe.yaml").write_text(
        "# @package _global_\n# A recipe with a planted bug.\ndefaults:\n  - override /data: digits\n"
        "name: badrecipe\ntask:\n  _target_: badrecipe.BadTrainer\nmodel:\n"
        "  _target_: badrecipe.ForcesTrainBN\n")
    bad = subprocess.run([sys.executable, "-m", "saferun", "check", "-cd", str(project),
                          "recipe=badrecipe"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "FAIL  eval purity" in bad.stdout and "running_mean" in bad.stdout


@pytest.mark.parametrize("recipe", ["tabular", pytest.param("digits", marks=pytest.mark.slow),
                                    pytest.param("charlm", marks=pytest.mark.slow)])
def test_every_shipped_recipe_passes_every_check(tmp_path, recipe):
    """No false alarm: each recipe, with every guard on, passes (exit status 0)."""
    good = subprocess.run([sys.executable, "-m", "saferun", "check", f"recipe={recipe}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert good.returncode == 0, good.stdout + good.stderr
    assert "14 checks: 14 passed, 0 warned, 0 failed." in good.stdout
    assert "superseded" not in good.stdout + good.stderr  # each check's Trainer has its own directory


def test_an_input_baseline_that_cannot_conclude_says_so_instead_of_blaming_the_inputs(tmp_path):
    """lr 1e-6: the loss does not move in 16 steps; the model does use its inputs."""
    cfg = load_config({**toy_config(tmp_path), "optim": {"_target_": "torch.optim.SGD", "lr": 1e-6}})
    [found] = run_checks(lambda c: ToyTrainer(c), cfg, only=["input baseline"])
    assert found.status == "skip" and found.finding.startswith("inconclusive: "), found
    assert "moved too little" in found.finding and "learning rate" in found.finding
    assert "does not seem to use its inputs" not in found.finding
    assert format_report([found]).splitlines() == [
        f"SKIP  input baseline     {found.finding}",
        "1 checks: 0 passed, 1 inconclusive, 0 warned, 0 failed."]
    # (a model that ignores its input still warns: tests/mistakes.py, "model ignores its input")


def test_lazy_modules_are_no_eval_purity_false_alarm(tmp_path):
    """nn.LazyLinear takes its shape at the first forward: in training, before any evaluation."""
    class Lazy(ToyTrainer):
        def build_model(self):
            return torch.nn.Sequential(torch.nn.LazyLinear(16), torch.nn.ReLU(), torch.nn.Linear(16, 3))

    [found] = run_checks(lambda c: Lazy(c), load_config(toy_config(tmp_path)), only=["eval purity"])
    assert found.status == "pass", found


def test_a_trainer_with_a_test_set_is_checked(tmp_path):
    """build_datasets may return (train, val, test): the data-overlap check unpacked two."""
    class WithTest(ToyTrainer):
        def build_datasets(self):
            train, val = super().build_datasets()
            return train, val, val

    cfg = load_config(toy_config(tmp_path))
    [found] = run_checks(lambda c: WithTest(c), cfg, only=["data overlap"])
    assert found.status == "pass", found


def test_compile_parity_is_checked_when_the_config_compiles(tmp_path):
    from toys import Net

    class CompilerSensitive(Net):  # a planted compiler bug: computes something else when traced
        def forward(self, x):
            out = super().forward(x)
            return out * 3 if torch.compiler.is_compiling() else out

    class Planted(ToyTrainer):
        def build_model(self):
            return CompilerSensitive()

    clean = results(ToyTrainer, tmp_path / "clean", compile=True, compile_backend="eager")
    assert clean["compile parity"].status == "pass", clean["compile parity"]
    found = results(Planted, tmp_path / "planted", compile=True, compile_backend="eager")
    parity = found["compile parity"]
    assert parity.status == "fail" and "compiled" in parity.finding, parity
    assert "trainer.compile=false" in parity.finding, parity


class TwoOptimizers(ToyTrainer):
    """Several named optimizers, as a GAN uses them: training_step calls the model's parts
    (not the model) and drives self.optimize(name, loss) itself."""

    def build_optimizer(self, params):
        return {"backbone": torch.optim.SGD(self.model.backbone.parameters(), lr=0.05),
                "head": torch.optim.SGD(self.model.head.parameters(), lr=0.05)}

    def training_step(self, batch):
        x, y = batch
        net = self.model
        h = net.backbone(x)
        self.optimize("head", torch.nn.functional.cross_entropy(net.head(h.detach()), y))
        self.optimize("backbone", torch.nn.functional.cross_entropy(net.head(h), y))
        return None


class Centred(torch.nn.Linear):
    def forward(self, h):
        return super().forward(h - h.mean(0))  # planted: every row depends on the whole batch


class MixesBatchTwoOptimizers(TwoOptimizers):
    def build_model(self):
        net = super().build_model()
        net.head = Centred(16, 3)
        return net


def test_a_trainer_with_several_optimizers_gets_the_checks_that_run_training_step(tmp_path):
    # eval purity and batch independence run training_step for its forward alone: its
    # self.optimize() calls update nothing there (the weights stay as they were)
    cfg = load_config(toy_config(tmp_path))
    only = ["eval purity", "batch independence"]
    found = {r.name: r for r in run_checks(lambda c: TwoOptimizers(c), cfg, only=only)}
    assert [r.status for r in found.values()] == ["pass", "pass"], found
    assert "no validation set" not in found["eval purity"].finding
    [mixed] = run_checks(lambda c: MixesBatchTwoOptimizers(c), cfg, only=["batch independence"])
    assert mixed.status == "fail" and "mixes" in mixed.finding, mixed
