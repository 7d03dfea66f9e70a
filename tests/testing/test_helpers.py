"""saferun.testing's helpers on toy Trainers: each passes on a correct one and fails, with a
message naming what is wrong, on one with a planted bug."""

import json
import random

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from saferun import testing
from toys import ToyTrainer, make_classification, toy_config

Failed = pytest.fail.Exception


def job(cls, tmp_path, **trainer):
    return testing.trainer(cls, toy_config(tmp_path, **trainer))


class Validating(ToyTrainer):
    """96 training samples in batches of 16: 6 steps an epoch; a validation set of 64."""

    def build_datasets(self):
        x, y = make_classification(160)
        return TensorDataset(x[:96], y[:96]), TensorDataset(x[96:], y[96:])


class CountsOutsideTheCheckpoint(Validating):
    """A curriculum kept in a plain attribute: a resumed run starts it again from zero."""

    calls = 0

    def training_step(self, batch):
        self.calls += 1
        return super().training_step(batch) * (1 + 0.1 * min(self.calls, 5))


def test_exact_resume_passes_at_each_named_stop_and_names_what_differs(tmp_path):
    testing.assert_resumes_exactly(job(Validating, tmp_path, batch_size=16),
                                   tmp_dir=tmp_path / "good")
    # the stops landed where named: one epoch is 6 steps; the straight run is 9
    saved = {d.name: sorted(p.name for p in (d / "checkpoints").iterdir())
             for d in (tmp_path / "good").iterdir() if d.name != "straight"}
    assert saved["mid-epoch"][0] == "step-00000003" and saved["epoch-end"][0] == "step-00000006"
    assert saved["validation"][0] == "step-00000007"
    with pytest.raises(Failed) as e:
        testing.assert_resumes_exactly(job(CountsOutsideTheCheckpoint, tmp_path, batch_size=16),
                                       stops=["mid-epoch"])
    message = str(e.value)
    assert "stopped by a SIGTERM during step 3 (mid-epoch)" in message
    assert "model.head.weight:" in message and "values differ" in message
    assert "outside its state_dict" in message


def test_golden_losses_write_compare_and_show_the_drift(tmp_path):
    path = tmp_path / "golden" / "toy.json"
    good = job(ToyTrainer, tmp_path)
    with pytest.raises(Failed, match="--saferun-update-golden"):
        testing.assert_golden_losses(good, path)  # no file yet
    with pytest.warns(UserWarning, match="wrote the golden losses of ToyTrainer"):
        testing.assert_golden_losses(good, path, steps=4, update=True)
    recorded = json.loads(path.read_text())
    assert recorded["steps"] == 4 and len(recorded["losses"]) == 4
    testing.assert_golden_losses(good, path, steps=4)
    changed = testing.trainer(ToyTrainer, {**toy_config(tmp_path), "optim": {
        "_target_": "torch.optim.SGD", "lr": 0.06}})  # 0.05 recorded
    with pytest.raises(Failed) as e:
        testing.assert_golden_losses(changed, path, steps=4)
    message = str(e.value)
    assert "drifted at step 2" in message and "<--" in message  # step 1 is before any update
    assert message.splitlines()[2].split()[0] == "1" and "<--" not in message.splitlines()[2]


class SyncsEveryStep(ToyTrainer):
    def training_step(self, batch):
        loss = super().training_step(batch)
        self.seen = loss.item()  # a host sync every step
        return loss


def test_host_syncs_are_named_with_their_line(tmp_path):
    testing.assert_no_host_syncs(job(ToyTrainer, tmp_path))
    with pytest.raises(Failed) as e:
        testing.assert_no_host_syncs(job(SyncsEveryStep, tmp_path))
    assert "test_helpers.py:" in str(e.value) and "self.seen = loss.item()" in str(e.value)
    assert "1.00/step" in str(e.value)
    testing.assert_no_host_syncs(job(SyncsEveryStep, tmp_path), allow=["self.seen ="])


class SharedGenerator(Dataset):
    """Noise from a generator object on the dataset: every DataLoader worker copies it."""

    def __init__(self):
        self.x, self.y = make_classification(128)
        self.g = torch.Generator().manual_seed(0)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.rand(8, generator=self.g), self.y[i]


class WorkersRepeat(ToyTrainer):
    def build_datasets(self):
        return SharedGenerator(), None


class SmallShift(Dataset):
    """Like the digits recipe's augmentation: two draws of -1, 0 or 1 from Python's random."""

    def __init__(self):
        self.x, self.y = make_classification(128)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + random.randint(-1, 1) + 10 * random.randint(-1, 1), self.y[i]


class Shifted(ToyTrainer):
    def build_datasets(self):
        return SmallShift(), None


def test_determinism_and_worker_seeding(tmp_path):
    testing.assert_deterministic(job(ToyTrainer, tmp_path))
    # With seed 0 the two workers' first draws happen to be equal: one draw each would
    # call correctly seeded workers "the same" (it did, for the digits recipe).
    testing.assert_deterministic(job(Shifted, tmp_path, num_workers=2))
    with pytest.raises(Failed, match="worker seeding .*same random augmentation"):
        testing.assert_deterministic(job(WorkersRepeat, tmp_path))


def test_the_check_report_as_a_test(tmp_path):
    with pytest.raises(Failed) as e:
        testing.assert_checks_pass(job(SyncsEveryStep, tmp_path), only=["host syncs", "determinism"])
    assert "host syncs did not pass" in str(e.value) and "PASS  determinism" in str(e.value)
    testing.assert_checks_pass(job(SyncsEveryStep, tmp_path), only=["host syncs"],
                               warn_ok=["host syncs"])


def test_exact_resume_refuses_an_epoch_too_long_for_a_short_test(tmp_path):
    with pytest.raises(Failed, match="an epoch of ToyTrainer is 128 steps, more than max_epoch_steps=60"):
        testing.assert_resumes_exactly(job(ToyTrainer, tmp_path, batch_size=2))


@pytest.mark.slow
def test_exact_resume_with_workers_and_no_validation_set(tmp_path):
    from toys import AugmentedTrainer  # random, NumPy and torch draws in every sample

    testing.assert_resumes_exactly(job(AugmentedTrainer, tmp_path, batch_size=16, num_workers=2),
                                   tmp_dir=tmp_path / "runs")
    # no validation set: the default stops leave "validation" out
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [
        "epoch-end", "mid-epoch", "straight"]
