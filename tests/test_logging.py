"""TensorBoard event files, read back, and the progress bar."""

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from saferun.loggers import LogLines, ProgressBar
from toys import ToyTrainer, toy_config


def read_events(run_dir):
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_tensorboard_has_every_metric_at_log_steps_and_the_config(tmp_path):
    cfg = toy_config(tmp_path, max_steps=20, log_every_n_steps=5, val_every_n_steps=10,
                     tensorboard=True)
    t = ToyTrainer(cfg)
    final = t.fit()
    acc = read_events(tmp_path / "run")
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/grad_norm", "train/lr", "perf/steps_per_sec",
            "perf/samples_per_sec", "val/loss", "val/acc"} <= tags
    assert [e.step for e in acc.Scalars("train/loss")] == [5, 10, 15, 20]
    assert [e.step for e in acc.Scalars("val/acc")] == [10, 20]
    assert acc.Scalars("train/lr")[0].value == pytest.approx(0.05)
    assert acc.Scalars("val/acc")[-1].value == pytest.approx(final["val/acc"])
    losses = [e.value for e in acc.Scalars("train/loss")]
    assert losses[-1] < losses[0]  # the loss curve is there and goes down
    config_text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "max_steps: 20" in config_text and "torch.optim.SGD" in config_text


def test_progress_bar_only_when_asked_or_on_a_terminal(tmp_path, capsys):
    quiet = ToyTrainer(toy_config(tmp_path, progress_bar=None))
    quiet.setup()  # under pytest stderr is not a terminal
    assert any(isinstance(c, LogLines) for c in quiet._callbacks.callbacks)
    assert not any(isinstance(c, ProgressBar) for c in quiet._callbacks.callbacks)

    shown = ToyTrainer(toy_config(tmp_path, progress_bar=True, max_steps=8, log_every_n_steps=4))
    shown.fit()
    err = capsys.readouterr().err
    assert "8/8" in err and "loss=" in err


class CrashesInStep7(ToyTrainer):
    crash = True

    def training_step(self, batch):
        if self.crash and self.state.step + 1 == 7:
            raise RuntimeError("planted crash")
        return super().training_step(batch)


def scalar_curves(run_dir):
    acc = read_events(run_dir)
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]
            if not tag.startswith("perf/")}  # throughput: wall-clock, differs between runs


def test_after_a_resume_each_step_is_shown_once_with_the_uninterrupted_values(tmp_path):
    def cfg(name, resume=None):
        c = toy_config(tmp_path, max_steps=8, log_every_n_steps=2, val_every_n_steps=4,
                       save_every_n_steps=4, tensorboard=True)
        c["trainer"]["run_dir"] = str(tmp_path / name)
        c["resume"] = resume
        return c

    # logged at 2 and 4, validated at 4, saved at 4 (after both), logged at 6, crashed in 7
    with pytest.raises(RuntimeError, match="planted crash"):
        CrashesInStep7(cfg("a")).fit()
    resumed = CrashesInStep7(cfg("a", resume="auto"))
    resumed.crash = False
    resumed.fit()
    ToyTrainer(cfg("b")).fit()
    curves = scalar_curves(tmp_path / "a")
    assert curves == scalar_curves(tmp_path / "b")  # step 6 once; step 4 as saved
    assert [s for s, _ in curves["train/loss"]] == [2, 4, 6, 8]
    texts = read_events(tmp_path / "a").Tensors("config/text_summary")
    assert [e.step for e in texts] == [0, 4]  # each run's config, at the step it started
