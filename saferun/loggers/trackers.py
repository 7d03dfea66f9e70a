"""Experiment trackers: MLflow (a local SQLite store by default) and Weights & Biases (offline by
default). Optional extras, imported only when chosen: `pip install saferun[mlflow]`,
`saferun[wandb]`. Like every logger they exist on rank 0 only and act at log points and
validation ends, where the metrics are host floats already.

A tracker run belongs to a run directory: its id is in a file of the run directory
(`run_files`), which moves aside with the course it belongs to. A resume=auto continues that
run; the steps the tracker already holds are not sent again (a resume is exact, so what the
interrupted run sent for them is what the resumed run computes). A fresh start or a change of
course (resume=PATH, here or into another run directory) starts a new run, linked to the run
the checkpoint's course logged to; nothing of the old run is changed.
"""

from __future__ import annotations

import glob
import html
import importlib
import json
import logging
import os
import struct
import time
import uuid
from typing import Any, Iterator, Mapping, Optional, Sequence

from ..callbacks import Callback, Media, TrainerView
from ..errors import ConfigError
from . import hparam_values

log = logging.getLogger("saferun")


def require(module: str, extra: str) -> Any:
    """Import an optional tracker's package, or say how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"logger.{extra}: the {module} package is not installed ({e}). "
                          f"Install it with: pip install 'saferun[{extra}]'") from None


def _image_hwc(value: Any) -> Any:
    """(C, H, W) or (H, W) tensor -> (H, W, C) NumPy array, as the trackers take images."""
    array = value.float().clamp(0, 1).numpy() if value.is_floating_point() else value.numpy()
    return array if array.ndim == 2 else array.transpose(1, 2, 0)


def _histogram(value: Any, bins: int = 64) -> dict[str, list[float]]:
    import torch

    flat = value.detach().float().flatten()
    counts, edges = torch.histogram(flat, bins=bins)
    return {"edges": edges.tolist(), "counts": counts.tolist()}


MLFLOW_RUN = "mlflow-run.json"  # <run_dir>/: the MLflow run this run directory's course logs to


# The stores MLflow can track to (a scheme may name a driver: postgresql+psycopg2://).
MLFLOW_SCHEMES = ("file", "sqlite", "postgresql", "mysql", "mssql", "http", "https", "databricks",
                  "databricks-uc", "uc")


def check_tracking_uri(uri: str) -> None:
    """Refuse, within seconds, a tracking URI MLflow cannot use: an unknown scheme, or a server
    that does not answer (MLflow would retry it for minutes, then print pages of tracebacks)."""
    import urllib.error
    import urllib.parse
    import urllib.request

    scheme = urllib.parse.urlsplit(uri).scheme.split("+")[0]
    if scheme and scheme not in MLFLOW_SCHEMES and len(scheme) > 1:  # (C:\ is a path)
        raise ConfigError(f"logger.mlflow.tracking_uri={uri}: MLflow has no store for "
                          f"'{scheme}://'; use http(s)://HOST:PORT, sqlite:///PATH or a directory.")
    if scheme in ("http", "https"):
        try:
            urllib.request.urlopen(uri, timeout=10).close()
        except urllib.error.HTTPError:
            pass  # a server answered
        except (OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            raise ConfigError(f"logger.mlflow.tracking_uri={uri}: no MLflow server answers there "
                              f"({reason}). Start it (mlflow server --host HOST --port PORT), or "
                              f"leave tracking_uri out for the local store "
                              f"(<run dir>/../mlflow.db).") from None


class MLflowLogger(Callback):
    """Metrics with their steps, the run's config as params (flattened, dotted keys), images,
    texts and histograms as artifacts, and at the end model.pt (model_ema.pt) and summary.json.

    The MLflow run belongs to the run directory (its id in <run_dir>/mlflow-run.json), never
    to a checkpoint that travels: a resume=auto continues it; a change of course (resume=PATH
    here or into another run directory) starts a new run, tagged saferun.previous_run_id with
    the checkpoint's run, holding that run's metrics up to the resumed step, then its own. A
    fresh start starts a new run and ends an earlier attempt's run left RUNNING (KILLED). A
    rollback (guards.nonfinite=rollback) goes on in a new linked run holding the history up
    to the restored step: MLflow cannot delete the points the rollback undid.

    Args:
        tracking_uri: where the runs go; default: sqlite:///<run_dir>/../mlflow.db, one store
            for the runs of one name (`mlflow ui --backend-store-uri sqlite:///PATH`).
        experiment: the MLflow experiment; default: the config's `name`, else "saferun".
        run_name: default: the run directory's name.
        tags: tags set on the run.
    """

    run_files = (MLFLOW_RUN,)

    def __init__(self, tracking_uri: Optional[str] = None, experiment: Optional[str] = None,
                 run_name: Optional[str] = None, tags: Optional[Mapping[str, str]] = None) -> None:
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        if tracking_uri:  # when built, before the run is accepted: MLflow retries a dead server for minutes
            check_tracking_uri(tracking_uri)
        self.tags = dict(tags or {})
        self.run_id: Optional[str] = None  # checkpointed: the run a course change links to
        self._client: Any = None
        self._held: dict[str, int] = {}  # per metric: the latest step the store holds (a resume)
        self._held_images: dict[str, int] = {}
        self._superseded: Optional[str] = None  # the run of a course set aside
        self._resumed_from = ""
        self._media_at: tuple[int, dict[str, int]] = (-1, {})  # same-name media at one step
        self._sent = -1  # checkpointed: the latest step sent (a rollback's new run holds up to it)
        self._rolled_back: Optional[int] = None  # a rollback's restored state: its step sent

    def on_fresh_start(self, view: TrainerView, aside: Optional[str]) -> None:
        self.run_id, self._superseded = None, _run_id(aside, MLFLOW_RUN)

    def on_course_change(self, view: TrainerView, aside: str, resumed: str, step: int) -> None:
        self._superseded, self._resumed_from = _run_id(aside, MLFLOW_RUN), resumed

    def on_fit_start(self, view: TrainerView) -> None:
        require("mlflow", "mlflow")
        from mlflow import MlflowClient

        root = os.path.dirname(os.path.abspath(view.run_dir))
        os.makedirs(root, exist_ok=True)
        self._client = MlflowClient(self.tracking_uri or f"sqlite:///{root}/mlflow.db")
        self._rolled_back = None
        mine = _run_id(view.run_dir, MLFLOW_RUN)
        if mine is not None:  # this run directory's course: continue its run
            self.run_id = mine
            self._continue(view)
        else:  # a new course (a fresh start, a change of course, a branch): a new run
            self._start(view, root, previous=self.run_id)
            _write_json(os.path.join(view.run_dir, MLFLOW_RUN),
                        {"run_id": self.run_id, "tracking_uri": self._client.tracking_uri})
        if self._superseded is not None and self._superseded != self.run_id:
            self._end_superseded()

    def _start(self, view: TrainerView, root: str, previous: Optional[str],
               step: Optional[int] = None) -> None:
        """A new MLflow run for this run directory; linked to `previous` (the run the course
        logged to), holding its history up to `step` (default: the resumed step)."""
        step = view.step if step is None else step
        from mlflow.entities import Param

        name = self.experiment or view.config.get("name") or "saferun"
        found = self._client.get_experiment_by_name(name)
        experiment = found.experiment_id if found is not None else self._client.create_experiment(
            name, artifact_location=f"file://{root}/mlartifacts")
        tags = {"saferun.run_dir": view.run_dir, **self.tags}
        if previous is not None:  # a new course: linked to the run its checkpoint logged to
            tags.update({"saferun.previous_run_id": previous, "saferun.resumed_step": str(step)})
            if self._resumed_from:  # (told by on_course_change)
                tags["saferun.resumed_from"] = self._resumed_from
        run = self._client.create_run(experiment, run_name=self.run_name or os.path.basename(
            os.path.abspath(view.run_dir)), tags=tags)
        self.run_id, self._held, self._held_images = run.info.run_id, {}, {}
        params = [Param(k, str(v)[:6000]) for k, v in hparam_values(view.config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per call
            self._client.log_batch(self.run_id, params=params[i:i + 100])
        if previous is not None:
            self._copy_past(previous, step)

    def _copy_past(self, previous: str, step: int) -> None:
        """The course's past, `previous`'s metrics up to `step`, into the new run (as
        metrics.jsonl gets its past lines): its history is then the run directory's."""
        from mlflow.entities import Metric

        try:
            keys = list(self._client.get_run(previous).data.metrics)
        except Exception as e:
            log.warning("MLflow: the checkpoint's run %s is not in %s (%s): the new run %s holds "
                        "this course from step %d only.", previous, self._client.tracking_uri,
                        e, self.run_id, step)
            return
        past = [Metric(m.key, m.value, m.timestamp, m.step) for key in keys
                for m in self._client.get_metric_history(previous, key) if m.step <= step]
        for i in range(0, len(past), 1000):  # MLflow takes at most 1000 metrics per call
            self._client.log_batch(self.run_id, metrics=past[i:i + 1000])
        self._held = _latest_steps(past)
        self._copy_media(previous, step)

    def _copy_media(self, previous: str, step: int) -> None:
        """`previous`'s images, texts and histograms up to `step` into the new run, under the
        same names (images/KEY+step+N+..., texts/NAME/step_N(-i).txt, histograms/...)."""
        import tempfile

        from mlflow.artifacts import download_artifacts

        kinds = [a.path for a in self._client.list_artifacts(previous)
                 if a.is_dir and a.path in ("images", "texts", "histograms")]
        with tempfile.TemporaryDirectory() as tmp:
            for kind in kinds:
                download_artifacts(run_id=previous, artifact_path=kind, dst_path=tmp,
                                   tracking_uri=self._client.tracking_uri)
            for folder, _, files in os.walk(tmp):
                for name in files:
                    if _media_step(name) <= step:
                        self._client.log_artifact(self.run_id, os.path.join(folder, name),
                                                  os.path.relpath(folder, tmp))

    def _continue(self, view: TrainerView) -> None:
        assert self.run_id is not None
        try:
            run = self._client.get_run(self.run_id)
        except Exception as e:
            raise ConfigError(f"logger.mlflow: this run directory's MLflow run {self.run_id} "
                              f"({os.path.join(view.run_dir, MLFLOW_RUN)}) is not in "
                              f"{self._client.tracking_uri} ({e}). Resume with the same "
                              f"logger.mlflow.tracking_uri.") from None
        # What the interrupted run sent after its checkpoint, metric by metric (a kill inside a
        # validation leaves that step's training metrics held and its val/* not): sent again,
        # a resume being exact, they would be the same values twice.
        self._held = _latest_steps([m for key in run.data.metrics
                                    for m in self._client.get_metric_history(self.run_id, key)])
        images = (a.path.rsplit("/", 1)[-1].split("+") for a in
                  self._client.list_artifacts(self.run_id, "images"))  # KEY+step+N+timestamp+...
        self._held_images = {}
        for name, _, step, *_ in (i for i in images if len(i) > 3 and i[1] == "step"):
            self._held_images[name] = max(self._held_images.get(name, -1), int(step))
        changed = {k: v for k, v in hparam_values(view.config).items()
                   if k in run.data.params and run.data.params[k] != str(v)[:6000]}
        if changed:  # MLflow refuses to change a param: the run keeps the values it started with
            log.warning("MLflow run %s keeps its params; the resumed config differs in %s.",
                        self.run_id, ", ".join(sorted(changed)))
        self._client.update_run(self.run_id, status="RUNNING")

    def _end_superseded(self) -> None:
        """The run of a course set aside, left RUNNING by a killed process: ended (KILLED)."""
        try:
            if self._client.get_run(self._superseded).info.status == "RUNNING":
                self._client.set_terminated(self._superseded, "KILLED")
        except Exception as e:  # another store: nothing of it here to end
            log.warning("MLflow: the run %s of the course set aside is not in %s (%s).",
                        self._superseded, self._client.tracking_uri, e)
        self._superseded = None

    def on_log(self, view: TrainerView, metrics: Mapping[str, float]) -> None:
        self._after_rollback(view)
        self._metrics(view.step, metrics)

    def on_validation_end(self, view: TrainerView, metrics: Mapping[str, float]) -> None:
        self._after_rollback(view)
        self._metrics(view.step, metrics)

    def _metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        if self._client is None:
            return
        now = int(time.time() * 1000)
        new = [Metric(k, float(v), now, step) for k, v in metrics.items()
               if step > self._held.get(k, -1)]
        if new:
            self._client.log_batch(self.run_id, metrics=new)
        self._sent = max(self._sent, step)

    def on_media(self, view: TrainerView, media: Sequence[Media]) -> None:
        if self._client is None:
            return
        self._after_rollback(view)
        for m in media:
            self._sent = max(self._sent, m.step)
            if m.kind == "image":
                if m.step > self._held_images.get(m.name.replace("/", "~"), -1):
                    self._client.log_image(self.run_id, _image_hwc(m.value), key=m.name, step=m.step)
                continue
            # one file each, also several of one name at one step; named by the step and the
            # order (the same again after a resume: what it rewrites is the same file)
            if self._media_at[0] != m.step:
                self._media_at = (m.step, {})
            seen = self._media_at[1]
            n = seen[m.kind + m.name] = seen.get(m.kind + m.name, -1) + 1
            path = f"{m.kind}s/{m.name}/step_{m.step:08d}" + (f"-{n}" if n else "")
            if m.kind == "histogram":
                self._client.log_dict(self.run_id, _histogram(m.value), path + ".json")
            else:
                self._client.log_text(self.run_id, m.value, path + ".txt")

    def on_fit_end(self, view: TrainerView, metrics: Mapping[str, float]) -> None:
        if self._client is None:
            return
        self._after_rollback(view)
        for name in ("model.pt", "model_ema.pt"):
            path = os.path.join(view.run_dir, name)
            if os.path.isfile(path):
                self._client.log_artifact(self.run_id, path)
        self._client.log_dict(self.run_id, {"step": view.step, "metrics": dict(metrics)},
                              "summary.json")
        self._client.set_terminated(self.run_id, "FINISHED")
        self._client = None

    def on_exception(self, view: TrainerView, exc: BaseException) -> None:
        if self._client is not None:
            self._client.set_terminated(self.run_id, "FAILED")
            self._client = None

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "sent": self._sent}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self._client is not None:  # a rollback mid-run: acted on at the next event (the
            self._rolled_back = int(state.get("sent", -1))  # policy may try older checkpoints)
            return
        self.run_id = state.get("run_id") or self.run_id
        self._sent = int(state.get("sent", -1))

    def _after_rollback(self, view: TrainerView) -> None:
        """guards.nonfinite=rollback restored a checkpoint: what this run was sent after it
        (its latest step sent before it was saved) is undone. MLflow cannot delete metric
        points, so the run goes on in a new MLflow run that holds this one's history up to
        that step, linked to it as a course change is; the abandoned run ends KILLED."""
        if self._rolled_back is None:
            return
        step, self._rolled_back, abandoned = self._rolled_back, None, self.run_id
        assert abandoned is not None
        self._client.set_tag(abandoned, "saferun.rolled_back_to_step", str(step))
        self._client.set_terminated(abandoned, "KILLED")
        self._start(view, os.path.dirname(os.path.abspath(view.run_dir)), abandoned, step)
        self._client.set_tag(self.run_id, "saferun.rolled_back_from", abandoned)
        _write_json(os.path.join(view.run_dir, MLFLOW_RUN),
                    {"run_id": self.run_id, "tracking_uri": self._client.tracking_uri})
        self._sent, self._media_at = step, (-1, {})


def _media_step(name: str) -> int:
    """The step of a media artifact's file name: KEY+step+N+... (images), step_N(-i).EXT."""
    if "+step+" in name:
        return int(name.split("+step+")[1].split("+")[0])
    return int(name.removeprefix("step_").split(".")[0].split("-")[0])


def _latest_steps(metrics: Sequence[Any]) -> dict[str, int]:
    latest: dict[str, int] = {}
    for m in metrics:
        latest[m.key] = max(latest.get(m.key, -1), m.step)
    return latest


def _run_id(folder: Optional[str], name: str) -> Optional[str]:
    """The tracker run id recorded in `folder`/`name` (a run directory, or a course set
    aside), or None."""
    path = os.path.join(folder, name) if folder is not None else ""
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return str(json.load(f)["run_id"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path} (the tracker run of this run directory's course) is "
                          f"unreadable ({e}). Move it aside to start a new tracker run.") from None


def _write_json(path: str, record: Mapping[str, Any]) -> None:
    """`record` into `path`, whole or not at all (a kill mid-write leaves the earlier one)."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


WANDB_RUN = os.path.join("wandb", "saferun-run.json")  # the W&B run id, the latest step sent


def wandb_records(data: bytes, block: int = 32768) -> Iterator[bytes]:
    """The records of a W&B transaction log (run-ID.wandb): a 7-byte header, then LevelDB's
    log format (32 KiB blocks of (checksum, length, type) chunks; types 1 and 4 end a record).
    A record cut off by a kill is left out."""
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4) and pos <= len(data):
            yield pending
        if kind in (1, 4):
            pending = b""


def wandb_latest_step(run_dir: str, run_id: str) -> int:
    """The latest step of W&B run `run_id` that W&B wrote to its transaction logs under
    <run_dir>/wandb (what survived a kill; -1: none). Read once, at a resume."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2

    latest = -1
    for path in glob.glob(os.path.join(run_dir, "wandb", "*run-*", f"run-{run_id}.wandb")):
        with open(path, "rb") as f:
            data = f.read()
        for raw in wandb_records(data):
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
            try:
                record.ParseFromString(raw)
            except DecodeError:
                continue
            if record.WhichOneof("record_type") == "history":
                steps = [i.value_json for i in record.history.item  # (a key, or nested_key)
                         if (i.key or "/".join(i.nested_key)) == "_step"]
                latest = max([latest] + [int(json.loads(v)) for v in steps])
    return latest


class WandbLogger(Callback):
    """Weights & Biases: metrics with their steps, the config, images, histograms and texts.
    Offline by default (<run_dir>/wandb/, upload later with `wandb sync`); online only with
    mode="online".

    The W&B run belongs to the run directory (<run_dir>/wandb/saferun-run.json): a resume=auto
    continues it, sending again what W&B may not hold (a process killed before W&B finished
    loses what W&B's service buffered: the resume names the steps after the last one W&B
    wrote to its transaction log); a fresh start or a change of course
    sets wandb/ aside with the course it belongs to and starts a new run (after a change of
    course its config names the previous run, saferun.previous_run_id, and the resumed step: it
    holds the steps after it).

    Args:
        project: the W&B project; default: the config's `name`, else "saferun".
        mode: "offline" (default), "online" or "disabled".
        entity, name, tags: as wandb.init takes them.
    """

    run_files = ("wandb",)

    def __init__(self, project: Optional[str] = None, mode: str = "offline",
                 entity: Optional[str] = None, name: Optional[str] = None,
                 tags: Optional[Sequence[str]] = None) -> None:
        if mode not in ("offline", "online", "disabled"):
            raise ConfigError(f"logger.wandb.mode is {mode!r}: offline, online or disabled.")
        self.project, self.mode, self.entity, self.name = project, mode, entity, name
        self.tags = list(tags or [])
        self.run_id: Optional[str] = None  # checkpointed: the run a course change links to
        self.sent = -1  # the latest step sent (checkpointed: after a resume, not sent again)
        self._run: Any = None
        self._wandb: Any = None
        self._held = -1  # after a resume: the latest step the W&B run holds for sure
        self._held_keys: set[str] = set()  # and what it holds of that step
        self._at_sent: list[str] = []  # what this run sent at its latest step
        self._own = ""

    def on_fresh_start(self, view: TrainerView, aside: Optional[str]) -> None:
        self.run_id, self.sent = None, -1

    def on_fit_start(self, view: TrainerView) -> None:
        wandb = self._wandb = require("wandb", "wandb")
        self._own = os.path.join(view.run_dir, WANDB_RUN)
        os.makedirs(os.path.dirname(self._own), exist_ok=True)
        config = dict(view.config)
        mine = _run_id(view.run_dir, WANDB_RUN)
        if mine is not None:  # this run directory's course: continue its run
            self.run_id = mine
            with open(self._own) as f:  # the steps an interrupted run sent after its checkpoint
                record = json.load(f)
            self._held, self._held_keys = int(record.get("sent", -1)), set(record.get("keys", ()))
            written = max(self._held, wandb_latest_step(view.run_dir, self.run_id))
            if self.sent > written:  # the checkpoint's process was killed before W&B finished
                log.warning("W&B: the process that saved the checkpoint was killed before W&B "
                            "had written what it was sent (W&B buffers it): W&B run %s may lack "
                            "steps %d to %d; metrics.jsonl and TensorBoard hold them. From step "
                            "%d on it gets every step.", self.run_id, written + 1, self.sent,
                            self.sent + 1)
        else:  # a new course (a fresh start, a change of course, a branch): a new run
            if self.run_id is not None:
                config["saferun"] = {"previous_run_id": self.run_id, "resumed_step": view.step}
            self.run_id, self.sent, self._held, self._held_keys = uuid.uuid4().hex[:12], -1, -1, set()
            _write_json(self._own, {"run_id": self.run_id, "sent": -1})
        self._run = wandb.init(
            project=self.project or view.config.get("name") or "saferun", entity=self.entity,
            name=self.name or os.path.basename(os.path.abspath(view.run_dir)), tags=self.tags,
            id=self.run_id, resume="allow", mode=self.mode, dir=view.run_dir,
            config=config, settings=wandb.Settings(silent=True))

    def on_log(self, view: TrainerView, metrics: Mapping[str, float]) -> None:
        self._send(view.step, dict(metrics))

    def on_validation_end(self, view: TrainerView, metrics: Mapping[str, float]) -> None:
        self._send(view.step, dict(metrics))

    def on_media(self, view: TrainerView, media: Sequence[Media]) -> None:
        w = self._wandb
        row: dict[str, Any] = {}
        for m in media:
            if m.kind == "image":
                row[m.name] = w.Image(_image_hwc(m.value))
            elif m.kind == "histogram":
                row[m.name] = w.Histogram(m.value.float().numpy())
            else:
                row[m.name] = w.Html(f"<pre>{html.escape(m.value)}</pre>")
        self._send(view.step, row)

    def _send(self, step: int, row: dict[str, Any]) -> None:
        # W&B takes steps in order only (a lower one is dropped); an equal one joins its row
        if self._run is None or step < self.sent:
            return
        if step <= self._held:
            if step == self._held and set(row) - self._held_keys:
                self._unsendable(step, sorted(set(row) - self._held_keys))
            return
        self._run.log(row, step=step)
        self._at_sent = (self._at_sent if step == self.sent else []) + list(row)
        self.sent = step

    def _unsendable(self, step: int, keys: list[str]) -> None:
        """The killed run began step `step` in W&B and did not finish it (a kill inside its
        validation): W&B's steps only go forward, so the rest cannot join that step."""
        log.warning("W&B: the interrupted run had sent part of step %d to W&B run %s; W&B takes "
                    "no more of a step once a later process has resumed the run, so %s of step "
                    "%d are not in it (metrics.jsonl and TensorBoard hold them).", step,
                    self.run_id, ", ".join(keys), step)
        self._held_keys.update(keys)
    def on_fit_end(self, view: TrainerView, metrics: Mapping[str, float]) -> None:
        if self._run is not None:
            self._run.summary.update(dict(metrics))
            self._finish(0)

    def on_exception(self, view: TrainerView, exc: BaseException) -> None:
        if self._run is not None:
            self._finish(1)

    def _finish(self, exit_code: int) -> None:
        """W&B's service writes what it was sent once the run finishes (a process killed
        before loses what it buffered): only then is what was sent recorded as held."""
        self._run.finish(exit_code=exit_code)
        self._run = None
        _write_json(self._own, {"run_id": self.run_id, "sent": self.sent, "keys": self._at_sent})

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "sent": self.sent}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.run_id = state.get("run_id") or self.run_id
        self.sent = int(state.get("sent", -1))
