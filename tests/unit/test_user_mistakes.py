"""A new user's first hour in Python (issue 36): habits from other frameworks and near misses
get a `SaferunError` that names the key or the call, the cause and the fix. The table below
keeps the bad inputs tried; each row is one mistake and the words its message must hold."""

from __future__ import annotations

import pytest
import torch

from saferun.config import load_config
from saferun.errors import ConfigError, SaferunError
from toys import ToyTrainer, toy_config

BAD_CONFIGS = [  # (config, the words the message names)
    ({"optimizer": {"_target_": "torch.optim.SGD", "lr": 0.1}}, ["'optimizer'", "Did you mean optim?"]),
    ({"trainer": {"num_train_epochs": 3}}, ["trainer.num_train_epochs", "Did you mean trainer.max_epochs?"]),
    ({"trainer": {"epochs": 3}}, ["trainer.epochs", "Did you mean trainer.max_epochs?"]),
    ({"trainer": {"warmup": 100}}, ["trainer.warmup", "Did you mean sched.warmup_steps?"]),
    ({"trainer": {"gradient_clip_val": 1.0}}, ["trainer.gradient_clip_val", "Did you mean trainer.max_grad_norm?"]),
    ({"trainer": {"accumulate_grad_batches": 4}},
     ["trainer.accumulate_grad_batches", "Did you mean trainer.accumulate?"]),
    ({"trainer": {"learning_rate": 0.1}}, ["trainer.learning_rate", "Did you mean optim.lr?"]),
    ({"scheduler": {"_target_": "x"}}, ["'scheduler'", "Did you mean sched?"]),
    ({"logger": ["tensorboard"]}, ["logger is a list", "{'tensorboard': {'_target_': "
                                   "'saferun.loggers.TensorBoardLogger'}}", "logger=tensorboard"]),
    ({"callbacks": ["early"]}, ["callbacks is a list", "{name: {'_target_': ...}}"]),
    ({"metrics": ["f1"]}, ["metrics is a list", "{name: {'_target_': ...}}"]),
]


@pytest.mark.parametrize("config, words", BAD_CONFIGS, ids=[str(c)[:40] for c, _ in BAD_CONFIGS])
def test_a_bad_config_names_the_key_and_the_fix(config, words):
    with pytest.raises(ConfigError) as caught:
        load_config(config)
    for w in words:
        assert w in str(caught.value)


@pytest.mark.parametrize("args", ["model_and_loader", "loader"])
def test_fit_with_a_model_or_loader_says_where_they_go(tmp_path, args):
    """Lightning's trainer.fit(model, loader): refused before anything is built or written."""
    trainer = ToyTrainer(toy_config(tmp_path))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 8)))
    given = (torch.nn.Linear(8, 3), loader) if args == "model_and_loader" else (loader,)
    with pytest.raises(SaferunError) as caught:
        trainer.fit(*given)  # type: ignore[call-arg]
    message = str(caught.value)
    for w in ["ToyTrainer.fit() takes no arguments", "build_model", "build_datasets", "DataLoader"]:
        assert w in message
    assert trainer.model is None and not (tmp_path / "run").exists()
