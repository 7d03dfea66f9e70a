"""MLflow and Weights & Biases, the real packages: the MLflow store read back through MLflow's own
client; W&B offline. From Python and from the command line; a resume continues the same run
without sending a step twice."""

import json
import os
import struct
import subprocess
import sys

import pytest
from pathlib import Path
import torch

from saferun.errors import ConfigError
from toys import ToyTrainer, toy_config


class Media(ToyTrainer):
    crash_at = 0

    def training_step(self, batch):
        if self.step == self.crash_at:
            raise RuntimeError("planted crash")
        if self.step % 3 == 0:
            self.log_image("grid", torch.full((3, 4, 4), self.step / 10))
            self.log_text("note", f"step {self.step}")
        self.log("w", torch.tensor(self.step / 30), reduce="last")
        return super().training_step(batch)


def config(tmp_path, logger, resume=None, **trainer):
    c = toy_config(tmp_path, max_steps=9, log_every_n_steps=3, val_every_n_steps=4,
                   save_every_n_steps=4, **trainer)
    c["logger"] = logger
    c["resume"] = resume
    return c


def history(client, run_id):
    run = client.get_run(run_id)
    return {k: [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, k),
                                                   key=lambda m: (m.step, m.timestamp))]
            for k in run.data.metrics if not k.startswith("perf/")}


def test_mlflow_store_holds_params_metrics_media_and_artifacts_and_a_resume_continues_the_run(tmp_path):
    from mlflow import MlflowClient

    crashing = Media(config(tmp_path, {"mlflow": {"experiment": "toy"}}))
    crashing.crash_at = 7
    with pytest.raises(RuntimeError, match="planted crash"):
        crashing.fit()
    t = Media(config(tmp_path, {"mlflow": {"experiment": "toy"}}, resume="auto"))
    final = t.fit()
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")  # the default store: beside the run
    runs = client.search_runs([client.get_experiment_by_name("toy").experiment_id])
    assert len(runs) == 1  # the resume continued the run
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params["trainer.max_steps"] == "9" and run.data.params["optim._target_"] == \
        "torch.optim.SGD"
    got = history(client, run.info.run_id)
    assert [s for s, _ in got["train/loss"]] == [3, 6, 9]  # step 6 once, though sent before the crash
    assert [s for s, _ in got["val/acc"]] == [4, 8, 9]
    assert got["train/w"][0] == (3, pytest.approx(0.1))
    assert got["val/acc"][-1][1] == pytest.approx(final["val/acc"])
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"model.pt", "summary.json", "texts", "images"} <= artifacts
    images = [a.path for a in client.list_artifacts(run.info.run_id, "images") if a.path.endswith(".png")]
    assert sorted(int(path.split("+step+")[1].split("+")[0]) for path in images) == [3, 6, 9]  # 6 once
    texts = {a.path for a in client.list_artifacts(run.info.run_id, "texts/train/note")}
    assert texts == {f"texts/train/note/step_{s:08d}.txt" for s in (3, 6, 9)}
    local = client.download_artifacts(run.info.run_id, "model.pt", str(tmp_path / "dl"))
    saved = torch.load(local, weights_only=True)
    assert all(torch.equal(saved[k], v) for k, v in t.model.state_dict().items())


@pytest.mark.slow
def test_mlflow_from_the_command_line_and_a_resume_elsewhere_gets_a_new_linked_run(tmp_path):
    from mlflow import MlflowClient

    def run(*overrides):
        cmd = [sys.executable, "-m", "saferun", "run", "recipe=tabular", "logger=mlflow",
               "trainer.log_every_n_steps=3", "trainer.val_every_n_steps=6", "trainer.device=cpu",
               "trainer.progress_bar=false", *overrides]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout.strip().splitlines()[-1].split("run directory ")[1]

    first = run("trainer.max_steps=6")
    second = run("trainer.max_steps=9", f"resume={first}", "force_resume=true")  # continued elsewhere
    (store,) = (tmp_path / "runs").glob("*/mlflow.db")  # beside the run directories
    client = MlflowClient(f"sqlite:///{store}")
    old, new = sorted(client.search_runs([e.experiment_id for e in client.search_experiments()]),
                      key=lambda r: r.info.start_time)
    # the new run directory's own MLflow run, linked to the first, holding its past to step 6
    assert new.data.tags["saferun.previous_run_id"] == old.info.run_id
    assert old.data.params["trainer.max_steps"] == "6" and new.data.params["trainer.max_steps"] == "9"
    assert [m.step for m in client.get_metric_history(old.info.run_id, "train/loss")] == [3, 6]
    assert [m.step for m in client.get_metric_history(new.info.run_id, "train/loss")] == [3, 6, 9]
    assert (Path(first) / "metrics.jsonl").is_file() and (Path(second) / "metrics.jsonl").is_file()


def test_a_missing_tracker_package_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'saferun\[wandb\]'"):
        ToyTrainer(config(tmp_path, {"wandb": {}})).fit()


def wandb_records(data, block=32768):
    """The records of a W&B transaction log (run-ID.wandb): after its 7-byte header, LevelDB's
    log format, 32 KiB blocks of (checksum, length, type) chunks; types 1 (whole) and 4 (last
    of several) end a record."""
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header: padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            yield pending
            pending = b""


def wandb_rows(run_dir):
    """The history rows of every offline W&B run under <run_dir>/wandb, parsed with wandb's own
    protobuf schema: [(run id, step, keys)]."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for raw in wandb_records(path.read_bytes()):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            if record.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
                rows.append((path.stem.removeprefix("run-"), json.loads(items["_step"]), sorted(items)))
    return rows


@pytest.mark.slow
def test_wandb_offline_writes_locally_and_a_resume_continues_the_same_run(tmp_path):
    os.environ["WANDB_SILENT"] = "true"
    crashing = Media(config(tmp_path, {"wandb": {"project": "toy"}}))
    crashing.crash_at = 7
    with pytest.raises(RuntimeError, match="planted crash"):
        crashing.fit()
    Media(config(tmp_path, {"wandb": {"project": "toy"}}, resume="auto")).fit()
    import wandb

    wandb.teardown()  # W&B's service writes the transaction log on its own: wait for it
    rows = wandb_rows(tmp_path / "run")
    assert len({run_id for run_id, _, _ in rows}) == 1  # one W&B run, continued
    assert [step for _, step, _ in rows] == [3, 4, 6, 8, 9]  # step 6 once, though sent before the crash
    assert [step for _, step, keys in rows if "train/grid/path" in keys] == [3, 6, 9]
    assert [step for _, step, keys in rows if "val/acc" in keys] == [4, 8, 9]
