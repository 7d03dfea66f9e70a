"""Issue 16: each planted mistake of tests/mistakes.py is caught with a message naming the
culprit; the explanation leaves the training state as the failure left it; no false alarm
on the quickstart and the shipped recipes."""

import logging

import pytest
import torch
from torch import nn

import saferun
from mistakes import CORPUS, ShapeMismatch, catch, caught, config_for
from saferun.diagnose.explain import UserCodeError
from toys import ToyTrainer, toy_config


@pytest.mark.parametrize("mistake", CORPUS, ids=[m.name for m in CORPUS])
def test_planted_mistake_is_caught_with_its_culprit(mistake, tmp_path):
    message = catch(mistake, tmp_path)
    assert caught(mistake, message), message


def test_explained_error_keeps_the_original_type_and_chains_it(tmp_path):
    m = next(m for m in CORPUS if m.trainer is ShapeMismatch)
    with pytest.raises(RuntimeError) as info:  # still a RuntimeError, for existing handlers
        m.trainer(config_for(m, tmp_path)).fit()
    err = info.value
    assert isinstance(err, UserCodeError) and isinstance(err, saferun.SaferunError)
    assert type(err.__cause__) is RuntimeError and err.original is err.__cause__
    assert "mat1 and mat2 shapes cannot be multiplied" in str(err.__cause__)


class FailsAfterBatchNorm(ToyTrainer):
    """BatchNorm and Dropout run before the failing layer, so a replay that did not restore the
    state would move the running statistics and the RNG."""

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 16), nn.Linear(12, 3))

    def training_step(self, batch):
        try:
            return super().training_step(batch)
        except RuntimeError:
            if not hasattr(self, "at_failure"):  # the first failure, not the explanation's replay
                self.at_failure = ({k: v.clone() for k, v in self.model.state_dict().items()},
                                   torch.get_rng_state(), [p.grad for p in self.model.parameters()])
            raise


def test_the_replay_that_finds_the_module_leaves_buffers_rng_and_grads_as_the_failure_left_them(tmp_path):
    t = FailsAfterBatchNorm(toy_config(tmp_path))
    with pytest.raises(saferun.SaferunError, match=r"module '3' \(Linear\)"):
        t.fit()
    state, rng, grads = t.at_failure
    now = t.model.state_dict()
    assert all(torch.equal(state[k], now[k]) for k in state), "a buffer moved"
    assert int(state["0.num_batches_tracked"]) == 1  # the failed forward's own update is kept
    assert torch.equal(rng, torch.get_rng_state())
    assert all(a is None and p.grad is None for a, p in zip(grads, t.model.parameters()))


def test_no_false_alarm_on_the_quickstart(tmp_path, caplog):
    class MyTrainer(saferun.Trainer):  # README's quickstart, shorter
        def build_model(self):
            return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 2))

        def build_datasets(self):
            x = torch.randn(1024, 8)
            y = (x.sum(dim=1) > 0).long()
            return (torch.utils.data.TensorDataset(x[:900], y[:900]),
                    torch.utils.data.TensorDataset(x[900:], y[900:]))

        def training_step(self, batch):
            x, y = batch
            return nn.functional.cross_entropy(self.model(x), y)

        def validation_step(self, batch):
            x, y = batch
            return {"loss": nn.functional.cross_entropy(self.model(x), y)}

    with caplog.at_level(logging.WARNING, logger="saferun"):
        MyTrainer({"trainer": {"max_steps": 20, "batch_size": 64, "log_every_n_steps": 10,
                               "run_dir": str(tmp_path), "progress_bar": False},
                   "optim": {"_target_": "torch.optim.AdamW", "lr": 3e-3}, "logger": {}}).fit()
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("recipe", ["tabular", "digits",
                                    pytest.param("charlm", marks=pytest.mark.slow)])
def test_no_false_alarm_at_setup_and_first_steps_of_the_recipes(recipe, tmp_path, caplog):
    from saferun.cli import compose_config
    from hydra.utils import get_class

    cfg = compose_config([f"recipe={recipe}", "debug=fast", "trainer.progress_bar=false",
                          f"trainer.run_dir={tmp_path}", "logger={}"])
    task = dict(cfg.task)
    with caplog.at_level(logging.WARNING, logger="saferun"):
        get_class(task.pop("_target_"))(cfg, **task).fit()
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


class Custom(Exception):
    pass


@pytest.mark.parametrize("raised", [KeyError("label"), Custom("mine")])
def test_any_exception_keeps_its_type_and_a_users_own_class_is_left_as_raised(tmp_path, raised):
    class Raises(ToyTrainer):
        def training_step(self, batch):
            raise raised

    with pytest.raises(type(raised)) as info:
        Raises(toy_config(tmp_path)).fit()
    if type(raised) is KeyError:  # a builtin type: explained, and still a KeyError
        assert "training_step failed at step 1" in str(info.value)
        assert "raise raised" in str(info.value) and info.value.__cause__ is raised
    else:  # the user's own class: untouched
        assert info.value is raised


def test_nan_input_fields_are_named_in_dataclass_and_dict_batches():
    import dataclasses

    from saferun.guards.batchinfo import describe_batch, nonfinite_fields

    @dataclasses.dataclass
    class Batch:
        image: torch.Tensor
        label: torch.Tensor

    x = torch.zeros(4, 3)
    x[2, 1] = float("nan")
    assert nonfinite_fields(Batch(x, torch.zeros(4)), [10, 11, 12, 13]) == \
        ["batch.image in dataset samples [12] (1 in all)"]
    assert nonfinite_fields({"image": x}) == ["batch['image'] in samples [2] (1 in all)"]
    assert describe_batch(Batch(x, torch.zeros(4)))[0].startswith("batch.image: float32 (4, 3)")
