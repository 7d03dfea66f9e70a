"""Errors in validation_step and predict_step explained when validate() and predict() are
called by the user, outside fit, before any training and after a resume: as fit explains them
(the step, the module and what it received, the batch), still the original exception type."""

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from saferun.diagnose.explain import UserCodeError
from toys import ToyTrainer, make_classification, toy_config


class BrokenEvaluation(ToyTrainer):
    """validation_step and predict_step drop a feature when `broken` is set."""

    broken = False

    def _inputs(self, batch: Any) -> torch.Tensor:
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return x[:, :-1] if self.broken else x

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        return {"loss": F.cross_entropy(self.model(self._inputs(batch)), batch[1])}

    def predict_step(self, batch: Any) -> torch.Tensor:
        return self.model(self._inputs(batch))


def explained(call, hook: str, step: int) -> str:
    with pytest.raises(RuntimeError) as info:  # still a RuntimeError, for existing handlers
        call()
    message = str(info.value)
    assert isinstance(info.value, UserCodeError), message
    assert message.startswith(f"{hook} failed at step {step}: a shape mismatch in module "
                              f"'backbone.0' (Linear), which received input[0]: float32 (32, 7) cpu"
                              ), message
    assert "mat1 and mat2 shapes cannot be multiplied (32x7 and 8x16)" in str(info.value.__cause__)
    return message


def test_validate_and_predict_alone_explain_their_steps(tmp_path):
    trainer = BrokenEvaluation(toy_config(tmp_path, val_batch_size=32))
    trainer.broken = True
    message = explained(trainer.validate, "validation_step", 0)
    assert "batch: batch[0]: float32 (32, 8) cpu; batch[1]: int64 (32,) cpu" in message
    x, _ = make_classification(64, seed=1)
    message = explained(lambda: trainer.predict(x), "predict_step", 0)
    assert "batch: batch: float32 (32, 8) cpu" in message
    test_set = TensorDataset(*make_classification(64, seed=2))
    message = explained(lambda: trainer.test(test_set), "test_step", 0)  # test_step: the default
    assert "batch: batch[0]: float32 (32, 8) cpu" in message
    # the replay that named the module left the model as evaluation found it: training mode
    assert all(m.training for m in trainer.model.modules())
    trainer.broken = False
    assert trainer.predict(x).shape == (64, 3)


def test_validate_and_predict_after_a_resume_name_the_resumed_step(tmp_path):
    cfg = toy_config(tmp_path, max_steps=4, val_batch_size=32)
    BrokenEvaluation(cfg).fit()
    resumed = BrokenEvaluation({**cfg, "resume": "auto"})
    resumed.broken = True
    explained(resumed.validate, "validation_step", 4)
    explained(lambda: resumed.predict(make_classification(32, seed=2)[0]), "predict_step", 4)
    assert resumed.state.step == 4


def test_an_error_in_validation_during_fit_is_explained_once(tmp_path):
    trainer = BrokenEvaluation(toy_config(tmp_path, max_steps=4, val_every_n_steps=2,
                                          val_batch_size=32))
    trainer.broken = True
    message = explained(trainer.fit, "validation_step", 2)
    assert message.count("original error:") == 1


def test_the_module_is_read_from_the_traceback_with_what_it_received():
    """Under torchrun the module is read from the traceback instead of found by a replay (which
    may wait in a collective): the deepest module running, and its arguments, *args too."""
    from torch import nn

    from saferun.diagnose.explain_ranks import locate_in_traceback

    class Joined(nn.Module):
        def forward(self, *parts):
            return torch.cat(parts, dim=1)  # parts of different batch sizes: raises here

    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(12, 3))
    with pytest.raises(RuntimeError) as info:
        model(torch.randn(4, 8))
    assert locate_in_traceback(info.value, model) == ("'1' (Linear)",
                                                      "input[0]: float32 (4, 16) cpu")
    model = nn.Sequential(nn.ReLU(), Joined())
    with pytest.raises(RuntimeError) as info:
        model[1](model[0](torch.randn(4, 6)), torch.randn(5, 2))
    assert locate_in_traceback(info.value, model) == (
        "'1' (Joined)", "input[0]: float32 (4, 6) cpu; input[1]: float32 (5, 2) cpu")


class BrokenLastMicroBatch(ToyTrainer):
    """trainer.accumulate=3 over 40 samples in batches of 16: the partial last micro-batch
    (8 samples) loses a feature."""

    n_train = 40

    def training_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x[:, :-1] if len(x) == 8 else x), y)


def test_an_error_under_accumulation_names_the_micro_batch(tmp_path):
    t = BrokenLastMicroBatch(toy_config(tmp_path, batch_size=16, accumulate=3, shuffle=False,
                                        max_steps=1))
    with pytest.raises(UserCodeError) as info:
        t.fit()
    message = str(info.value)
    assert message.startswith("training_step failed at step 1 (micro-batch 3 of 3): a shape "
                              "mismatch in module 'backbone.0' (Linear), which received "
                              "input[0]: float32 (8, 7) cpu"), message
    assert "batch: batch[0]: float32 (8, 8) cpu; batch[1]: int64 (8,) cpu" in message
