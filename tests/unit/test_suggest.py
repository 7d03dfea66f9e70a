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
