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
    ({"trainer": {"resume": "auto"}},  # the right name in the wrong place: where it goes
     ["trainer.resume", "Did you mean resume? 'resume' is a key at the top level, not under trainer."]),
    ({"lr": 0.1}, ["Did you mean optim.lr? 'lr' is a key under optim, not at the top level."]),
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


class LogsAfterFit(ToyTrainer):
    def after_fit(self, metrics):
        self.log("final_acc", metrics["val/acc"])


class LogsTextAfterFit(ToyTrainer):
    def after_fit(self, metrics):
        self.log_text("note", "done")


@pytest.mark.parametrize("trainer, call", [(LogsAfterFit, "self.log('final_acc', ...)"),
                                           (LogsTextAfterFit, "self.log_text('note', ...)")])
def test_logging_in_after_fit_is_refused_not_dropped(tmp_path, trainer, call):
    """after_fit runs after the last log point: what it logs would be written nowhere."""
    with pytest.raises(SaferunError) as caught:
        trainer(toy_config(tmp_path, max_steps=4)).fit()
    for w in [f"{call} in after_fit", "after the last log point", "validation_step", "test()"]:
        assert w in str(caught.value)
    assert (tmp_path / "run" / "model.pt").exists()  # the trained model is kept


class LogsAPhase(ToyTrainer):
    def training_step(self, batch):
        self.log("phase", "warmup")
        return super().training_step(batch)


def test_a_text_given_to_self_log_is_pointed_at_log_text(tmp_path):
    with pytest.raises(SaferunError) as caught:
        LogsAPhase(toy_config(tmp_path, max_steps=2)).fit()
    message = str(caught.value)
    assert "self.log_text('phase', 'warmup')" in message and ".mean()" not in message


class WithBatchIndex(ToyTrainer):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch)


def test_the_batch_index_habit_points_at_self_step_as_the_docs_teach(tmp_path):
    with pytest.raises(SaferunError) as caught:
        WithBatchIndex(toy_config(tmp_path)).setup()
    message = str(caught.value)
    assert "self.step" in message and "self.epoch" in message and "self.state.step" not in message


class TestsInAfterFit(ToyTrainer):
    def validation_step(self, batch):
        out = super().validation_step(batch)
        self.log("logged", out["acc"])
        return out

    def after_fit(self, metrics):
        self.tested = self.test(self.build_datasets()[1])


def test_test_called_from_after_fit_still_logs_its_metrics(tmp_path):
    trainer = TestsInAfterFit(toy_config(tmp_path, max_steps=4))
    trainer.fit()
    assert {"test/loss", "test/acc", "test/logged"} <= set(trainer.tested)


@pytest.mark.parametrize("entry", ["test", "predict"])
def test_evaluating_before_any_training_says_once_that_the_weights_are_the_initial_ones(
        tmp_path, caplog, entry):
    import logging

    data = ToyTrainer(toy_config(tmp_path)).build_datasets()[1]
    trainer = ToyTrainer(toy_config(tmp_path))
    with caplog.at_level(logging.WARNING, logger="saferun"):
        getattr(trainer, entry)(data)
        getattr(trainer, entry)(data)
    said = [r.getMessage() for r in caplog.records if "initial weights" in r.getMessage()]
    assert len(said) == 1 and f"{entry}(): ToyTrainer has not trained" in said[0], said
    assert "fit()" in said[0] and "from_run" in said[0]
    caplog.clear()
    trained = ToyTrainer(toy_config(tmp_path / "b", max_steps=2))
    trained.fit()
    with caplog.at_level(logging.WARNING, logger="saferun"):
        getattr(trained, entry)(data)
        getattr(ToyTrainer.from_run(str(tmp_path / "b" / "run"), "last"), entry)(data)
        copied = tmp_path / "weights.pt"  # a file of weights: its step is unknown (0)
        copied.write_bytes((tmp_path / "b" / "run" / "model.pt").read_bytes())
        getattr(ToyTrainer.from_run(str(tmp_path / "b" / "run"), str(copied)), entry)(data)
    assert not [r for r in caplog.records if "initial weights" in r.getMessage()]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A run whose config builds its model from a node (what load_model instantiates)."""
    root = tmp_path_factory.mktemp("finished")
    trainer = ToyTrainer({**toy_config(root, max_steps=2), "model": {"_target_": "toys.Net"}})
    trainer.fit()
    return root / "run", trainer.model


@pytest.mark.parametrize("content, words", [
    ("whole", ["holds a pickled object (toys.Net)", "torch.save(model.state_dict(), PATH)"]),
    ("cut", ["is not a readable weights file", "cut short"]),
    ("text", ["is not a readable weights file", "not written by torch.save"]),
])
def test_a_weights_file_that_is_no_state_dict_says_so_without_weights_only_false(
        tmp_path, finished_run, content, words):
    run_dir, model = finished_run
    path = tmp_path / "weights.pt"
    if content == "text":
        path.write_text("hello")
    else:
        torch.save(model if content == "whole" else model.state_dict(), path)
        if content == "cut":
            path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(SaferunError) as caught:
        saferun_load_model(run_dir, str(path))
    message = str(caught.value)
    for w in words:
        assert w in message, message
    assert "weights_only=False" not in message and "\n" not in message


def saferun_load_model(run_dir, checkpoint):
    from saferun import load_model

    return load_model(run_dir, checkpoint)


class Picture:
    """Stands for a PIL image: an object default_collate cannot batch."""

    size = (8, 1)


class PictureData(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return Picture(), 0


class PictureTrainer(ToyTrainer):
    def build_datasets(self):
        return PictureData(), None


@pytest.mark.parametrize("workers", [0, 1])
def test_a_sample_default_collate_cannot_batch_says_how_to_convert_it(tmp_path, workers):
    with pytest.raises(SaferunError) as caught:
        PictureTrainer(toy_config(tmp_path, max_steps=2, num_workers=workers)).fit()
    message = str(caught.value)
    for w in ["default collate cannot batch a sample holding <class 'test_user_mistakes.Picture'>",
              "__getitem__", "pil_to_tensor", "collate_fn"]:
        assert w in message, message
    assert "Traceback" not in message


class FloatLabels(ToyTrainer):
    def training_step(self, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.model(x), y.float())


def test_float_labels_for_cross_entropy_are_named_as_the_labels(tmp_path):
    with pytest.raises(SaferunError) as caught:
        FloatLabels(toy_config(tmp_path, max_steps=2)).fit()
    message = str(caught.value)
    assert "cross_entropy and nll_loss take class indices as int64" in message
    assert "y.long()" in message and "parameters are" not in message.split("what to do")[0]
