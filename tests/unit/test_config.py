import pytest

import saferun
from saferun.config import Config, TrainerConfig, load_config


def test_defaults_are_plain_dataclasses():
    cfg = load_config(None)
    assert isinstance(cfg, Config) and isinstance(cfg.trainer, TrainerConfig)
    assert cfg.optim == {"_target_": "torch.optim.AdamW", "lr": 1e-3}


def test_dict_and_dataclass_inputs_agree():
    a = load_config({"trainer": {"max_steps": 7}, "seed": 3})
    b = load_config(Config(trainer=TrainerConfig(max_steps=7), seed=3))
    assert a == b


@pytest.mark.parametrize("override, words", [
    ({"trainer": {"max_steps": "abc"}}, ["trainer.max_steps", "abc"]),
    ({"trainer": {"max_stepz": 5}}, ["unknown config key", "trainer.max_stepz"]),
    ({"trainer": {"max_steps": 0}}, ["trainer.max_steps", "> 0"]),
    ({"trainer": {"log_every_n_steps": 0}}, ["trainer.log_every_n_steps"]),
    ({"trainer": {"max_grad_norm": 0.0}}, ["trainer.max_grad_norm"]),
    ({"trainer": {"precision": "fp8"}}, ["trainer.precision", "bf16"]),
    ({"trainer": {"eval_grad_mode": "eval"}}, ["trainer.eval_grad_mode", "inference_mode"]),
    ({"optim": {"lr": -0.1}}, ["optim.lr", ">= 0"]),
    ({"optim": {"lrr": 0.1}}, ["optim", "lrr", "Accepted"]),
    ({"optim": {"_target_": "torch.optim.Adamm"}}, ["optim._target_", "torch.optim.Adamm"]),
    ({"sched": {"lr": 1}}, ["sched", "_target_"]),
    ({"trainer": {"save_best": "val_ema/acc"}},
     ["trainer.save_best=val_ema/acc", "trainer.ema is off", "trainer.ema.decay"]),
    ({"trainer": {"sched_metric": "val_ema/loss"}}, ["trainer.sched_metric=val_ema/loss"]),
])
def test_bad_config_names_the_key(override, words):
    with pytest.raises(saferun.ConfigError) as e:
        load_config(override)
    for w in words:
        assert w in str(e.value)


def test_dataclass_instance_with_wrong_type_is_rejected():
    with pytest.raises(saferun.ConfigError, match="trainer.batch_size"):
        load_config(Config(trainer=TrainerConfig(batch_size="many")))  # type: ignore[arg-type]


def test_trainer_validates_config_at_construction():
    with pytest.raises(saferun.ConfigError, match="trainer.max_steps"):
        saferun.Trainer({"trainer": {"max_steps": -1}})


@pytest.mark.parametrize("lr, words", [
    ("3e-3", ["optim.lr must be a number", "the string '3e-3'", "unquoted"]),
    ("abc", ["optim.lr must be a number", "the string 'abc', not a number"]),
])
def test_a_string_where_the_target_takes_a_number_names_the_key(lr, words):
    """Not torch's "'<=' not supported between 'float' and 'str'" when the optimizer is built."""
    with pytest.raises(saferun.ConfigError) as e:
        load_config({"optim": {"lr": lr}})
    for w in words:
        assert w in str(e.value)
    assert load_config({"optim": {"lr": 3}}).optim["lr"] == 3  # an int where the default is a float


def test_a_target_under_a_moved_saferun_module_names_where_it_is_now():
    with pytest.raises(saferun.ConfigError) as e:
        load_config({"logger": {"mlflow": {"_target_": "saferun.trackers.MLflowLogger"}}})
    assert "logger.mlflow._target_: cannot import 'saferun.trackers.MLflowLogger'" in str(e.value)
    assert "saferun.trackers moved: name it saferun.loggers.trackers.MLflowLogger" in str(e.value)
