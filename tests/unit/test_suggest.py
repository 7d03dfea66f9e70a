"""Misspelt config keys name the closest valid key, in Python and on the command line."""

import pytest

import saferun
from saferun.config import Config
from saferun.suggest import did_you_mean, unknown_override


@pytest.mark.parametrize("cfg, hint", [
    ({"trainer": {"max_stepz": 3}}, "Did you mean trainer.max_steps?"),
    ({"trainr": {"max_steps": 3}}, "Did you mean trainer?"),
    ({"guards": {"anomaly_replai": True}}, "Did you mean guards.anomaly_replay?"),
])
def test_unknown_key_in_a_config_suggests_the_closest(cfg, hint):
    with pytest.raises(saferun.ConfigError, match=hint.replace("?", r"\?")):
        saferun.Trainer(cfg)


def test_overrides_are_checked_before_hydra_and_valid_ones_pass():
    assert "Did you mean trainer.max_steps?" in unknown_override(["trainer.max_stepz=5"], Config)
    assert "Did you mean guards.nonfinite?" in unknown_override(["gards.nonfinite=skip"], Config)
    ok = ["recipe=charlm", "optim=sgd", "optim.lr=1e-3,3e-3", "trainer.max_steps=3", "debug=fast",
          "+callbacks.x._target_=a.B", "~logger.tensorboard", "hydra.run.dir=x", "seed=3",
          "model.width=5", "guards=strict", "guards.spikes=skip", "-m", "--cfg"]
    assert unknown_override(ok, Config) is None
    assert did_you_mean("completely_unrelated_zzz", Config) == ""


@pytest.mark.parametrize("override, hint", [
    ("lr=1e-3", "Did you mean optim.lr?"),  # the same last part under another node
    ("max_steps=5", "Did you mean trainer.max_steps?"),
    ("warmup_steps=5", "Did you mean sched.warmup_steps?"),
    ("+trainer.max_stepz=5", "Did you mean trainer.max_steps?"),
    ("+trainer.warmup=5", "Did you mean sched.warmup_steps?"),  # a habit (suggest.HABITS), not trainer.ema
    ("trainer.num_train_epochs=3", "Did you mean trainer.max_epochs?"),  # Hugging Face's name
    ("trainer.ema_decai=0.9", None),
])
def test_a_suggestion_matches_the_keys_last_part_or_there_is_none(override, hint):
    problem = unknown_override([override], Config)
    assert problem is not None and override.split("=")[0].lstrip("+") in problem
    if hint is None:
        assert "Did you mean" not in problem, problem
    else:
        assert hint in problem, problem


@pytest.mark.parametrize("option", ["debug=fastt", "optim=adamm"])
def test_a_misspelt_group_option_is_refused_with_the_options(option):
    """debug was an optional group, where Hydra drops an option it cannot find: debug=fastt
    then trained the whole recipe without a word."""
    from hydra.errors import MissingConfigException

    from saferun.cli import compose_config

    group = option.split("=")[0]
    with pytest.raises(MissingConfigException, match=f"Could not find '{group}/"):
        compose_config([option])
    assert compose_config(["debug=fast"]).trainer.max_steps < compose_config([]).trainer.max_steps
