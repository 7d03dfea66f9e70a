"""`resume` applies to every entry point: validate() and predict() evaluate the checkpoint's
weights (not the untrained initial ones), and fit() still continues exactly after them."""

import pytest
import torch
from torch.utils.data import TensorDataset

import saferun
from toys import ToyTrainer, make_classification, toy_config, weights


def config(tmp_path, steps=6, resume=None, **trainer):
    cfg = toy_config(tmp_path, max_steps=steps, save_every_n_steps=4, **trainer)
    cfg["resume"] = resume
    return cfg


@pytest.fixture()
def trained(tmp_path):
    t = ToyTrainer(config(tmp_path))  # checkpoints at steps 4 and 6 in tmp_path/run
    t.fit()
    return t


def test_validate_and_predict_use_the_run_or_checkpoint_named_by_resume(tmp_path, trained):
    run = str(tmp_path / "run")
    x, y = make_classification(40, seed=9)
    # a run directory: its newest checkpoint; batch size and workers may differ for evaluation
    t = ToyTrainer(config(tmp_path, resume=run, batch_size=8, num_workers=1))
    metrics = t.validate()  # batches of 8 instead of 32: the same means up to summation order
    assert metrics == pytest.approx({k: v for k, v in trained.state.metrics.items()
                                     if k.startswith("val/")}, rel=1e-6)
    assert t.state.step == 6
    # the same weights, bitwise; the predictions in batches of 8 against 32 may round apart in
    # the last bit (which matmul kernel runs depends on the rows, on AVX-512 machines among others)
    assert all(torch.equal(a, b) for a, b in zip(weights(t).values(), weights(trained).values()))
    torch.testing.assert_close(t.predict(TensorDataset(x, y)), trained.predict(TensorDataset(x, y)))
    # one checkpoint
    step4 = tmp_path / "run" / "checkpoints" / "step-00000004"
    t4 = ToyTrainer(config(tmp_path, resume=str(step4)))
    t4.predict(TensorDataset(x, y))
    saved = saferun.checkpoint.load_checkpoint(step4)["model"]
    assert all(torch.equal(weights(t4)[k], saved[k]) for k in saved) and t4.state.step == 4


def test_evaluating_with_another_model_config_is_refused(tmp_path, trained):
    cfg = config(tmp_path, resume=str(tmp_path / "run"))
    cfg["model"] = {"_target_": "toys.Net", "hidden": 32}  # the checkpoint's config has none
    with pytest.raises(saferun.ConfigError, match=r"model\._target_.*force_resume=true"):
        ToyTrainer(cfg).validate()


def test_resume_auto_without_a_checkpoint_refuses_to_evaluate_untrained_weights(tmp_path):
    x, y = make_classification(8)
    for evaluate in (lambda t: t.validate(), lambda t: t.predict(TensorDataset(x, y))):
        with pytest.raises(saferun.SaferunError, match=r"resume=auto found no checkpoint.*untrained"):
            evaluate(ToyTrainer(config(tmp_path, resume="auto")))


def test_fit_after_validate_still_resumes_exactly(tmp_path, trained):
    straight = ToyTrainer(config(tmp_path, steps=10, run_dir=str(tmp_path / "straight")))
    straight.fit()
    t = ToyTrainer(config(tmp_path, steps=10, resume="auto"))  # tmp_path/run, at step 6
    t.validate()
    t.fit()
    assert t.state.step == 10
    assert all(torch.equal(a, b) for a, b in zip(weights(t).values(), weights(straight).values()))
