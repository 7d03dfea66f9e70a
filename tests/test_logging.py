"""TensorBoard event files, read back, and the progress bar."""

import json

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
    assert any(isinstance(c, LogLines) for c in quiet.callbacks)
    assert not any(isinstance(c, ProgressBar) for c in quiet.callbacks)

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


def test_an_empty_logger_mapping_means_no_loggers_from_python_and_the_command_line(tmp_path):
    from omegaconf import OmegaConf

    from saferun.cli import compose_config
    from saferun.config import default_loggers, load_config
    from saferun.loggers import MetricsJsonl, TensorBoardLogger

    assert load_config({}).logger == {
        "tensorboard": {"_target_": "saferun.loggers.TensorBoardLogger"},
        "jsonl": {"_target_": "saferun.loggers.MetricsJsonl"}}
    assert load_config({"logger": {}}).logger == {}
    assert load_config(OmegaConf.create({"logger": {}})).logger == {}
    assert compose_config(["logger=none"]).logger == {}
    assert set(compose_config([]).logger) == {"tensorboard", "jsonl"}
    assert set(compose_config(["logger=tensorboard"]).logger) == {"tensorboard"}
    cfg = toy_config(tmp_path, max_steps=4)  # toy_config: "logger": {}
    trainer = ToyTrainer(cfg)
    trainer.fit()
    built = {type(c) for c in trainer.callbacks}
    assert not built & {TensorBoardLogger, MetricsJsonl}
    assert not {p.name for p in (tmp_path / "run").iterdir()} & {"tensorboard", "metrics.jsonl"}
    # a mapping is the whole set: to add a logger, list the defaults too
    assert load_config({"logger": {"jsonl": {"_target_": "saferun.loggers.MetricsJsonl"}}}).logger \
        == {"jsonl": {"_target_": "saferun.loggers.MetricsJsonl"}}
    both = load_config({"logger": {**default_loggers(), "lines": {"_target_": "saferun.loggers.LogLines"}}})
    assert list(both.logger) == ["tensorboard", "jsonl", "lines"]
    assert compose_config(["logger.jsonl=null"]).logger == {  # the defaults less one
        "tensorboard": {"_target_": "saferun.loggers.TensorBoardLogger"}}


def test_a_logger_set_to_none_removes_that_one_from_the_defaults_in_python_as_on_the_command_line():
    from saferun.cli import compose_config
    from saferun.config import load_config
    from saferun.errors import ConfigError
    from saferun.loggers import TensorBoardLogger
    from saferun.loop.components import configured_callbacks

    tensorboard = {"_target_": "saferun.loggers.TensorBoardLogger"}
    mine = {"_target_": "saferun.loggers.LogLines"}
    cfg = load_config({"logger": {"jsonl": None}})  # was: no logger at all
    assert cfg.logger == {"tensorboard": tensorboard} == compose_config(["logger.jsonl=null"]).logger
    assert load_config(cfg).logger == cfg.logger  # a Config given again keeps its set
    assert load_config({"logger": {"jsonl": None, "mine": mine}}).logger == {
        "tensorboard": tensorboard, "mine": mine}  # +logger.mine=... logger.jsonl=null
    assert load_config({"logger": {"mine": mine}}).logger == {"mine": mine}  # no None: whole
    # on the command line the composed set is whole: logger=jsonl less jsonl is none at all
    assert compose_config(["logger=jsonl", "logger.jsonl=null"]).logger == {}
    with pytest.raises(ConfigError, match="None removes a default logger .*not jsnol"):
        load_config({"logger": {"jsnol": None}})
    built = configured_callbacks(load_config({"logger": {"jsonl": None}, "trainer": {
        "progress_bar": False}}), True, "cpu")
    assert [type(c) for c in built if isinstance(c, TensorBoardLogger)] == [TensorBoardLogger]
    assert len(built) == 2  # TensorBoard, and the log lines


def test_hparams_view_holds_the_config_and_the_final_metrics(tmp_path):
    from tensorboard.plugins.hparams import plugin_data_pb2

    cfg = toy_config(tmp_path, max_steps=8, log_every_n_steps=4, val_every_n_steps=4,
                     tensorboard=True)
    final = ToyTrainer(cfg).fit()
    acc = read_events(tmp_path / "run")
    content = acc.PluginTagToContent("hparams")
    data = {tag: plugin_data_pb2.HParamsPluginData.FromString(raw) for tag, raw in content.items()}
    experiment = data["_hparams_/experiment"].experiment
    metric_names = {m.name.tag for m in experiment.metric_infos}
    assert {"val/acc", "val/loss", "train/loss"} <= metric_names
    assert not any(n.startswith("perf/") for n in metric_names)
    session = data["_hparams_/session_start_info"].session_start_info
    assert session.hparams["optim.lr"].number_value == pytest.approx(0.05)
    assert session.hparams["optim._target_"].string_value == "torch.optim.SGD"
    assert session.hparams["trainer.max_steps"].number_value == 8
    assert session.hparams["sched"].string_value == "null"
    # each metric's value in the table is its scalar's last point: the final metrics
    assert acc.Scalars("val/acc")[-1].value == pytest.approx(final["val/acc"])


def test_a_finished_run_continued_shows_the_config_it_ended_with_in_the_hparams_view(tmp_path):
    """TensorBoard reads an HParams entry from the first event file that holds one: the entry
    of the first end (max_steps 4) must not stand for the run that went on to 8."""
    from tensorboard.plugins.hparams import plugin_data_pb2

    cfg = toy_config(tmp_path, max_steps=4, log_every_n_steps=4, val_every_n_steps=4,
                     tensorboard=True)
    ToyTrainer(cfg).fit()
    cfg["trainer"]["max_steps"], cfg["resume"] = 8, "auto"
    ToyTrainer(cfg).fit()
    session = plugin_data_pb2.HParamsPluginData.FromString(read_events(tmp_path / "run")
        .PluginTagToContent("hparams")["_hparams_/session_start_info"]).session_start_info
    assert session.hparams["trainer.max_steps"].number_value == 8
    assert session.hparams["resume"].string_value == "auto"
    # (the scalars are not compared here: two writers of one process within one second can
    # get file names that TensorBoard sorts out of order, .11 before .9; separate runs cannot)


class NanOnceAt7(ToyTrainer):
    fired = False

    def training_step(self, batch):
        loss = super().training_step(batch)
        if self.state.step + 1 == 7 and not self.fired:
            self.fired = True
            return loss + float("nan")
        return loss


def test_a_rollback_leaves_each_step_once_in_tensorboard_and_metrics_jsonl(tmp_path):
    # saved at 4 and logged at 2, 4, 6; step 7 is NaN; the log point at 8 rolls back to 4; the
    # steps 5-8 run again on the next data and are logged again: once, with the new values
    cfg = toy_config(tmp_path, max_steps=12, log_every_n_steps=2, val_every_n_steps=4,
                     save_every_n_steps=4, tensorboard=True)
    cfg["logger"] = {**cfg["logger"], "jsonl": {"_target_": "saferun.loggers.MetricsJsonl"}}
    cfg["guards"] = {"nonfinite": "rollback"}
    trainer = NanOnceAt7(cfg)
    trainer.fit()
    curves = scalar_curves(tmp_path / "run")
    assert [s for s, _ in curves["train/loss"]] == [2, 4, 6, 8, 10, 12]
    assert all(len({s for s, _ in c}) == len(c) for c in curves.values()), curves
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if x["kind"] == "train"]
    assert [x["step"] for x in train] == [2, 4, 6, 8, 10, 12]
    assert [x["step"] for x in lines if x["kind"] == "val"] == [4, 8, 12]
    assert all(x["epoch"] >= 0 and x["time"] > 0 for x in lines)
    # the two agree: TensorBoard shows what metrics.jsonl holds (the values after the rollback)
    assert [v for _, v in curves["train/loss"]] == pytest.approx([x["train/loss"] for x in train])


def test_a_shared_log_dir_keeps_the_other_runs_hparams_entry_and_says_so(tmp_path, caplog):
    """Two runs given one logger.tensorboard.log_dir: the second one's end (and its resumed
    end) must not delete the first one's HParams entry; its start warns of the merge."""
    shared = tmp_path / "tb"

    def cfg(name, max_steps=2, resume=None):
        c = toy_config(tmp_path / name, max_steps=max_steps, log_every_n_steps=2)
        c["logger"] = {"tensorboard": {"_target_": "saferun.loggers.TensorBoardLogger",
                                       "log_dir": str(shared)}}
        c["resume"] = resume
        return c

    ToyTrainer(cfg("a")).fit()
    first = {p.name: p.read_bytes() for p in shared.glob("*.hparams")}
    assert len(first) == 1
    ToyTrainer(cfg("b")).fit()
    assert f"TensorBoard: {shared} already holds another run's event files" in caplog.text
    caplog.clear()
    ToyTrainer(cfg("b", max_steps=4, resume="auto")).fit()  # b continued: replaces only its own
    assert "already holds" not in caplog.text
    entries = {p.name: p.read_bytes() for p in shared.glob("*.hparams")}
    assert len(entries) == 2 and all(entries[name] == data for name, data in first.items())


def test_the_c_checksum_of_event_records_is_tensorboards_own():
    # saferun/loggers/checksum.py: the record checksum in C gives the pure-Python one's values
    import random

    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as python_crc
    from saferun.loggers.checksum import masked_crc32c

    rng = random.Random(0)
    for n in (0, 1, 3, 8, 12, 63, 600, 4097):
        data = bytes(rng.randrange(256) for _ in range(n))
        assert masked_crc32c(data) == python_crc(data), n


def test_event_files_are_written_with_the_c_checksum_and_read_back_checked(tmp_path, monkeypatch):
    # TensorBoard's reader checks each record's checksum with its own pure-Python code
    from tensorboard.summary.writer import record_writer
    from saferun.loggers import checksum

    monkeypatch.setattr(record_writer, "masked_crc32c", record_writer.masked_crc32c)  # (restored)
    ToyTrainer(toy_config(tmp_path, max_steps=8, log_every_n_steps=4, tensorboard=True)).fit()
    assert record_writer.masked_crc32c is checksum.masked_crc32c  # the writer used it
    assert [e.step for e in read_events(tmp_path / "run").Scalars("train/loss")] == [4, 8]

    # a checksum that differs from TensorBoard's is refused: the writer keeps its own
    monkeypatch.setattr(record_writer, "masked_crc32c", checksum._python_crc())
    monkeypatch.setattr(checksum, "masked_crc32c", lambda data: checksum._python_crc()(data) ^ 1)
    assert not checksum.use_c_checksum()
    assert record_writer.masked_crc32c is checksum._python_crc()
