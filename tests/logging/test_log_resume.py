"""A run interrupted mid-window and resumed logs what the uninterrupted run logs: every
reduction, every image, histogram and text, once each (real TensorBoard files read back);
`self.step` and `self.epoch` match the logged steps in every hook."""

import json

import pytest
import torch
from tensorboard.backend.event_processing import plugin_event_accumulator
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import saferun
from toys import ToyTrainer, toy_config


class Probe(saferun.Callback):
    """Needs the model: logs an image of its output on a fixed batch at each validation."""

    def on_evaluate(self, view, model, log):
        out = model(torch.ones(4, 8))  # (4, 3)
        log.log_image("probe", torch.sigmoid(out).unsqueeze(0))
        log.log_text("probe_text", f"step {view.step}")
        log.log("probe_max", out.max(), reduce="max")


class Logs(ToyTrainer):
    crash_at = 0

    def training_step(self, batch):
        if self.step == self.crash_at:
            raise RuntimeError("planted crash")
        w = torch.tensor(self.step / 30)
        for reduce in ("last", "min", "max", "sum", "mean"):
            self.log(f"w_{reduce}", w, reduce=reduce)
        if self.step % 2:
            self.log_image("grid", torch.full((1, 4, 4), self.step / 10))
            self.log_histogram("logits", self.model.head.weight)
        if self.step in (4, 5):
            self.log_text("note", f"training step {self.step}")
        return super().training_step(batch)


def config(tmp_path, name, resume=None):
    c = toy_config(tmp_path, max_steps=9, log_every_n_steps=3, val_every_n_steps=4,
                   save_every_n_steps=4, tensorboard=True)
    c["trainer"]["run_dir"] = str(tmp_path / name)
    c["logger"]["jsonl"] = {"_target_": "saferun.loggers.MetricsJsonl"}
    c["resume"] = resume
    return c


def events(run_dir):
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={
        "scalars": 0, "tensors": 0, "images": 0, "histograms": 0})
    acc.Reload()
    tags = acc.Tags()
    got = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in tags["scalars"]
           if not t.startswith("perf/")}
    got.update({t: [(e.step, e.encoded_image_string) for e in acc.Images(t)] for t in tags["images"]})
    got.update({t: [(e.step, e.histogram_value.sum, e.histogram_value.num) for e in acc.Histograms(t)]
                for t in tags["histograms"]})
    # texts through the accumulator TensorBoard's server uses (the legacy one above does not
    # apply a resumed writer's purge to tensors, which texts are)
    served = plugin_event_accumulator.EventAccumulator(str(run_dir / "tensorboard"),
                                                       size_guidance={"tensors": 0})
    served.Reload()
    got.update({t: [(e.step, e.tensor_proto.string_val[0]) for e in served.Tensors(t)]
                for t in served.Tags()["tensors"] if t.endswith("text_summary") and t != "config/text_summary"})
    return got


def test_resumed_mid_window_logs_every_value_and_media_once_as_uninterrupted(tmp_path):
    # logged at 3, 6, 9; validated at 4, 8, 9; saved at 4 (mid-window: steps 4..6), crashed in 7
    crashing = Logs(config(tmp_path, "a"), callbacks=[Probe()])
    crashing.crash_at = 7
    with pytest.raises(RuntimeError, match="planted crash"):
        crashing.fit()
    Logs(config(tmp_path, "a", resume="auto"), callbacks=[Probe()]).fit()
    Logs(config(tmp_path, "b"), callbacks=[Probe()]).fit()
    resumed, straight = events(tmp_path / "a"), events(tmp_path / "b")
    assert resumed == straight
    assert [s for s, _ in straight["train/grid"]] == [3, 3, 6, 9, 9]  # steps 1, 3; 5; 7, 9
    assert [s for s, _ in straight["train/note/text_summary"]] == [6, 6]
    assert [s for s, _ in straight["val/probe"]] == [4, 8, 9]
    assert straight["train/w_last"][0] == (3, pytest.approx(0.1))
    jsonl = lambda run: [{k: v for k, v in json.loads(x).items() if not k.startswith(("perf/", "time"))}  # noqa: E731
                         for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
    assert jsonl("a") == jsonl("b")
    assert "val/probe_max" in jsonl("b")[-1]


def test_step_and_epoch_in_every_hook_match_the_logged_steps(tmp_path):
    seen = []

    class Where(ToyTrainer):
        n_train = 64  # 2 steps an epoch

        def build_model(self):
            seen.append(("build_model", self.step, self.epoch))
            return super().build_model()

        def training_step(self, batch):
            seen.append(("training_step", self.step, self.epoch))
            return super().training_step(batch)

        def validation_step(self, batch):
            seen.append(("validation_step", self.step, self.epoch))
            return super().validation_step(batch)

        def finish_validation(self, metrics):
            seen.append(("finish_validation", self.step, self.epoch))
            return metrics

        def after_fit(self, metrics):
            seen.append(("after_fit", self.step, self.epoch))

    class Logged(saferun.Callback):
        def on_log(self, view, metrics):
            seen.append(("on_log", view.step, view.epoch))

    t = Where(toy_config(tmp_path, max_steps=4, log_every_n_steps=1, val_every_n_steps=2,
                         val_batch_size=64), callbacks=[Logged()])
    t.fit()
    assert seen == [("build_model", 0, 0),
                    ("training_step", 1, 0), ("on_log", 1, 0),
                    ("training_step", 2, 0), ("on_log", 2, 0),
                    ("validation_step", 2, 0), ("finish_validation", 2, 0),
                    ("training_step", 3, 1), ("on_log", 3, 1),
                    ("training_step", 4, 1), ("on_log", 4, 1),
                    ("validation_step", 4, 1), ("finish_validation", 4, 1),
                    ("after_fit", 4, 1)]
    with pytest.raises(AttributeError):
        t.step = 3  # read-only


@pytest.mark.slow  # ~7 s (Hydra compose, the digits data); on_evaluate + log_image run by default above
def test_the_gan_recipe_logs_a_grid_of_generated_digits(tmp_path):
    from recipe_tools import build_recipe
    from saferun.loggers import TensorBoardLogger

    build_recipe("gan", tmp_path, "trainer.max_steps=4", "trainer.val_every_n_steps=2",
                 "trainer.limit_val_batches=1", "task.sample_digits=0",
                 callbacks=[TensorBoardLogger()]).fit()
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0})
    acc.Reload()
    grids = acc.Images("val/digits")
    assert [(e.step, e.width, e.height) for e in grids] == [(2, 32, 32), (4, 32, 32)]
