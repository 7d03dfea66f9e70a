"""The trackers (MLflow, W&B offline) over a run's whole life: a change of course in the same
run directory or into another one, a fresh start, a SIGKILL inside a validation or before the
first checkpoint. Each tracker run is compared step by step with the metrics.jsonl of the run
directory it belongs to: a course change gets a new tracker run linked to the old one, which
keeps what it held; a kill and resume=auto leaves one run equal to metrics.jsonl."""

import json
import os
import subprocess
import sys

import pytest
import torch

from test_trackers import wandb_records
from toys import TOYS_PATH, SelfSignalling, ToyTrainer, toy_config

pytest.importorskip("mlflow")


def config(run_dir, logger, max_steps=12, resume=None, lr=0.05, **trainer):
    c = toy_config(run_dir.parent, max_steps=max_steps, log_every_n_steps=2, val_every_n_steps=3,
                   save_every_n_steps=4, run_dir=str(run_dir), **trainer)
    c["optim"]["lr"] = lr
    c["logger"] = {**logger, "jsonl": {}}
    c["resume"] = None if resume is None else str(resume)
    c["force_resume"] = resume is not None and resume != "auto"
    return c


MLFLOW = {"mlflow": {"experiment": "toy"}}


def from_jsonl(run_dir):
    """metrics.jsonl as {metric: [(step, value)]} (perf/ timings left out)."""
    history: dict = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for key, value in record.items():
            if key not in ("kind", "step", "epoch", "time") and not key.startswith("perf/"):
                history.setdefault(key, []).append((record["step"], value))
    return history


def client_of(run_dir):
    from mlflow import MlflowClient

    return MlflowClient(f"sqlite:///{run_dir.parent}/mlflow.db")  # the default store


def mlflow_runs(run_dir):
    client = client_of(run_dir)
    experiment = client.get_experiment_by_name("toy").experiment_id
    return client, sorted(client.search_runs([experiment]), key=lambda r: r.info.start_time)


def from_mlflow(client, run_id):
    run = client.get_run(run_id)
    return {k: [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, k),
                                                   key=lambda m: (m.step, m.timestamp))]
            for k in run.data.metrics if not k.startswith("perf/")}


def artifact(client, run_id, name, tmp_path):
    folder = tmp_path / f"download-{run_id}"
    folder.mkdir(exist_ok=True)
    return torch.load(client.download_artifacts(run_id, name, str(folder)), weights_only=True)


def same_weights(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- a change of course


@pytest.mark.parametrize("where", ["same", "other"])
def test_mlflow_a_change_of_course_gets_a_new_linked_run_and_the_old_run_keeps_its_course(tmp_path, where):
    """resume=PATH in the course's own run directory, or into another one beside it (the
    default store is shared): a new MLflow run, linked to the old one, holding exactly that
    directory's metrics.jsonl and model.pt; the old run keeps its own course and model.pt."""
    first = tmp_path / "first"
    ToyTrainer(config(first, MLFLOW)).fit()
    old_history = from_jsonl(first)
    old_model = torch.load(first / "model.pt", weights_only=True)
    run_dir = first if where == "same" else tmp_path / "branch"
    ToyTrainer(config(run_dir, MLFLOW, resume=first / "checkpoints" / "step-00000004", lr=0.01)).fit()

    client, runs = mlflow_runs(first)
    assert len(runs) == 2
    old, new = runs
    assert {old.info.status, new.info.status} == {"FINISHED"}
    assert new.data.tags["saferun.previous_run_id"] == old.info.run_id
    assert new.data.tags["saferun.resumed_step"] == "4"
    assert new.data.tags["saferun.resumed_from"] == str(first / "checkpoints" / "step-00000004")
    assert from_mlflow(client, new.info.run_id) == from_jsonl(run_dir)  # its past up to 4, then its own
    assert from_mlflow(client, old.info.run_id) == old_history  # untouched
    assert same_weights(artifact(client, new.info.run_id, "model.pt", tmp_path),
                        torch.load(run_dir / "model.pt", weights_only=True))
    assert same_weights(artifact(client, old.info.run_id, "model.pt", tmp_path), old_model)
    if where == "same":  # the run's tracker file went aside with the course it belongs to
        [aside] = first.glob("superseded-*")
        assert json.loads((aside / "mlflow-run.json").read_text())["run_id"] == old.info.run_id
    assert json.loads((run_dir / "mlflow-run.json").read_text())["run_id"] == new.info.run_id


# ---------------------------------------------------------------- several media of one name


class SeveralMedia(ToyTrainer):
    """Two texts of one name at each log point, a histogram per validation batch."""

    def training_step(self, batch):
        if self.step % 2 == 0:  # the log point's own step
            self.log_text("note", f"first at {self.step}")
            self.log_text("note", f"second at {self.step}")
        return super().training_step(batch)

    def validation_step(self, batch):
        self.log_histogram("inputs", batch[0])
        return super().validation_step(batch)


def test_mlflow_keeps_every_text_and_histogram_of_one_name_at_one_log_point(tmp_path):
    run_dir = tmp_path / "run"
    c = config(run_dir, MLFLOW, max_steps=4)
    c["trainer"]["val_batch_size"] = 16  # 64 validation samples: 4 histograms per validation
    SeveralMedia(c).fit()
    client, [run] = mlflow_runs(run_dir)
    rid = run.info.run_id

    def files(folder):
        return sorted(a.path for a in client.list_artifacts(rid, folder))

    texts = files("texts/train/note")
    assert len(texts) == 2 * 2  # two per log point, log points 2 and 4
    got = sorted(open(client.download_artifacts(rid, p, str(tmp_path / "t"))).read() for p in texts)
    assert got == sorted(f"{which} at {s}" for which in ("first", "second") for s in (2, 4))
    histograms = files("histograms/val/inputs")
    assert len(histograms) == 4 * 2  # validations at steps 3 and 4
    counts = [json.load(open(client.download_artifacts(rid, p, str(tmp_path / "h"))))["counts"]
              for p in histograms]
    assert all(sum(c) == 16 * 8 for c in counts)  # each one batch of 16 samples of 8 features


# ---------------------------------------------------------------- killed, then resume=auto


def killed(run_dir, logger, plant, max_steps=12):
    """Run the toy in a subprocess that signals itself where `plant` says, then resume=auto."""
    cfg = config(run_dir, logger, max_steps=max_steps)
    proc = subprocess.run([sys.executable, TOYS_PATH, json.dumps(cfg), json.dumps(plant)],
                          capture_output=True, text=True, timeout=300)
    if plant["signum"] == 9:
        assert proc.returncode == -9, proc.stdout + proc.stderr
    else:  # a stop: the checkpoint saved, the exit non-zero
        assert proc.returncode not in (0, -plant["signum"]), proc.stdout + proc.stderr
    again = config(run_dir, logger, max_steps=max_steps, resume="auto")
    again["force_resume"] = False
    return SelfSignalling(again).fit()


def test_mlflow_after_a_kill_inside_a_validation_holds_that_validation(tmp_path):
    """SIGKILL inside the validation of step 6 (the store already holds step 6's training
    metrics; the checkpoint is step 4's): the resumed run sends val/* of step 6, and the one
    run equals metrics.jsonl step by step."""
    run_dir = tmp_path / "run"
    killed(run_dir, MLFLOW, {"signal_at": 6, "signum": 9, "in_validation": True})
    client, runs = mlflow_runs(run_dir)
    assert [r.info.status for r in runs] == ["FINISHED"]
    history = from_mlflow(client, runs[0].info.run_id)
    assert 6 in [s for s, _ in history["val/loss"]]
    assert history == from_jsonl(run_dir)


def test_mlflow_after_a_kill_before_the_first_checkpoint_leaves_no_running_run(tmp_path):
    """SIGKILL at step 3, before the first checkpoint: resume=auto starts over and sets the
    earlier attempt's files aside; its MLflow run is ended (KILLED), not left RUNNING, and the
    new run equals metrics.jsonl step by step."""
    run_dir = tmp_path / "run"
    killed(run_dir, MLFLOW, {"signal_at": 3, "signum": 9})
    client, runs = mlflow_runs(run_dir)
    assert [r.info.status for r in runs] == ["KILLED", "FINISHED"]
    assert from_mlflow(client, runs[1].info.run_id) == from_jsonl(run_dir)
    [aside] = run_dir.glob("superseded-*")
    assert json.loads((aside / "mlflow-run.json").read_text())["run_id"] == runs[0].info.run_id


# ---------------------------------------------------------------- W&B offline


def from_wandb(run_dir):
    """The history of every offline W&B run under <run_dir>/wandb (not those set aside), as
    {run id: {metric: [(step, value)]}}, parsed with wandb's own protobuf schema."""
    from wandb.proto import wandb_internal_pb2

    import wandb

    wandb.teardown()  # W&B's service writes the transaction log on its own: wait for it
    runs: dict = {}
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        history = runs.setdefault(path.stem.removeprefix("run-"), {})
        for raw in wandb_records(path.read_bytes()):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            if record.WhichOneof("record_type") != "history":
                continue
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            for key, value in items.items():
                if not key.startswith(("_", "perf/")):
                    history.setdefault(key, []).append((items["_step"], value))
    return runs


@pytest.mark.parametrize("event", ["fresh", "course"])
def test_wandb_offline_logs_the_new_course_after_a_fresh_start_or_a_course_change(tmp_path, event):
    os.environ["WANDB_SILENT"] = "true"
    wandb = {"wandb": {"project": "toy"}}
    run_dir = tmp_path / "run"
    ToyTrainer(config(run_dir, wandb, max_steps=8)).fit()
    [before] = from_wandb(run_dir).values()
    assert before == from_jsonl(run_dir)
    resume = "fresh" if event == "fresh" else run_dir / "checkpoints" / "step-00000004"
    ToyTrainer(config(run_dir, wandb, max_steps=8, resume=resume, lr=0.01)).fit()
    [aside] = run_dir.glob("superseded-*")
    assert (aside / "wandb").is_dir()  # the earlier course's W&B files went aside with it
    [(run_id, after)] = from_wandb(run_dir).items()
    jsonl = from_jsonl(run_dir)
    if event == "course":  # the new W&B run holds the new course; its past is in the old run
        jsonl = {k: [(s, v) for s, v in points if s > 4] for k, points in jsonl.items()}
        jsonl = {k: v for k, v in jsonl.items() if v}
    assert after == jsonl
    [old_id] = from_wandb(aside)
    assert run_id != old_id  # a new W&B run
    link = wandb_config(run_dir).get("saferun")
    assert link == (None if event == "fresh" else {"previous_run_id": old_id, "resumed_step": 4})


def wandb_config(run_dir):
    """The config of the offline W&B run under <run_dir>/wandb, from its run record."""
    from wandb.proto import wandb_internal_pb2

    [path] = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    for raw in wandb_records(path.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "run":
            return {i.key: json.loads(i.value_json) for i in record.run.config.update}
    raise AssertionError(f"no run record in {path}")


def test_wandb_after_a_stop_inside_a_validation_says_what_it_cannot_add(tmp_path, caplog):
    """SIGTERM inside the validation of step 6: the W&B run already holds step 6's training
    metrics, and W&B's steps only go forward, so the resumed run's val/* of step 6 cannot join
    it. The one W&B run equals metrics.jsonl step by step but for them, and the resumed run
    says so, naming them."""
    os.environ["WANDB_SILENT"] = "true"
    run_dir = tmp_path / "run"
    with caplog.at_level("WARNING", logger="saferun"):
        killed(run_dir, {"wandb": {"project": "toy"}}, {"signal_at": 6, "signum": 15, "in_validation": True})
    [history] = from_wandb(run_dir).values()  # one W&B run id (a folder per process)
    jsonl = {k: [(s, v) for s, v in points if not (s == 6 and k.startswith("val/"))]
             for k, points in from_jsonl(run_dir).items()}
    assert history == jsonl
    [said] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("W&B")]
    assert "val/acc, val/loss of step 6 are not in it" in said


def test_wandb_after_a_sigkill_sends_every_step_after_the_checkpoint_and_says_what_it_may_lack(
        tmp_path, caplog):
    """SIGKILL inside the validation of step 6 (checkpoint: step 4): W&B's service had not
    written what the killed process sent, so the resumed run sends every step after the
    checkpoint (step 6's training metrics and val/* included) and says which steps W&B may
    lack; after the checkpoint the W&B run equals metrics.jsonl step by step."""
    os.environ["WANDB_SILENT"] = "true"
    run_dir = tmp_path / "run"
    with caplog.at_level("WARNING", logger="saferun"):
        killed(run_dir, {"wandb": {"project": "toy"}}, {"signal_at": 6, "signum": 9, "in_validation": True})
    [history] = from_wandb(run_dir).values()
    after = {k: [(s, v) for s, v in points if s > 4] for k, points in history.items()}
    assert after == {k: [(s, v) for s, v in points if s > 4] for k, points in from_jsonl(run_dir).items()}
    [said] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("W&B")]
    assert "may lack steps 0 to 4;" in said


def test_the_lifecycle_events_reach_a_callback_with_the_folder_set_aside(tmp_path):
    """A callback's own files in the run directory (`run_files`) move aside with the course
    they belong to, and it hears where they went: on a fresh start and on a course change."""
    from saferun.callbacks import Callback

    heard = []

    class Owner(Callback):
        run_files = ("owned.txt",)

        def on_fit_start(self, view):
            (tmp_path / "run" / "owned.txt").write_text(str(len(heard)))

        def on_fresh_start(self, view, aside):
            heard.append(("fresh", aside and os.path.basename(aside)))

        def on_course_change(self, view, aside, resumed, step):
            heard.append(("course", os.path.basename(aside), os.path.basename(resumed), step))

    run_dir = tmp_path / "run"
    ToyTrainer(config(run_dir, {}, max_steps=8), callbacks=[Owner()]).fit()
    c = config(run_dir, {}, max_steps=8, resume=run_dir / "checkpoints" / "step-00000004")
    ToyTrainer(c, callbacks=[Owner()]).fit()
    ToyTrainer(config(run_dir, {}, max_steps=8, resume="fresh"), callbacks=[Owner()]).fit()
    assert [h[0] for h in heard] == ["fresh", "course", "fresh"]
    assert heard[0][1] is None and heard[1][2:] == ("step-00000004", 4)
    # each course's own file went aside with it, into the folder the callback was told of
    assert (run_dir / heard[1][1] / "owned.txt").read_text() == "1"
    assert (run_dir / heard[2][1] / "owned.txt").read_text() == "2"


@pytest.mark.parametrize("owned", ["owned.txt", ("logs/owned.txt",), ("..",)])
def test_run_files_that_are_not_plain_names_are_refused(tmp_path, owned):
    """A string (its letters would be the names) or a path is refused, naming the callback,
    before anything is moved or trained."""
    from saferun import SaferunError
    from saferun.callbacks import Callback

    class Owner(Callback):
        run_files = owned

    with pytest.raises(SaferunError, match=r"Owner\.run_files is .*plain names"):
        ToyTrainer(config(tmp_path / "run", {}, max_steps=2), callbacks=[Owner()]).fit()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
