"""Experiment trackers: MLflow (a local SQLite store by default) and Weights & Biases (offline by
default). Optional extras, imported only when chosen: `pip install saferun[mlflow]`,
`saferun[wandb]`. Like every logger they exist on rank 0 only and act at log points and
validation ends, where the metrics are host floats already.

A resumed run continues the same tracker run (its id is in the logger's checkpointed state).
The steps the tracker already holds are not sent again: a resume is exact, so what the
interrupted run sent for them is what the resumed run computes.
"""

from __future__ import annotations

import html
import importlib
import logging
import os
import time
import uuid
from typing import Any, Mapping, Optional, Sequence

from .callbacks import Callback, TrainerView
from .errors import ConfigError
from .loggers import hparam_values
from .loop.logbook import Media

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

    Args:
        tracking_uri: where the runs go; default: sqlite:///<run_dir>/../mlflow.db, one store
            for the runs of one name (`mlflow ui --backend-store-uri sqlite:///PATH`).
        experiment: the MLflow experiment; default: the config's `name`, else "saferun".
        run_name: default: the run directory's name.
        tags: tags set on the run.
    """

    def __init__(self, tracking_uri: Optional[str] = None, experiment: Optional[str] = None,
                 run_name: Optional[str] = None, tags: Optional[Mapping[str, str]] = None) -> None:
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        if tracking_uri:  # when built, before the run is accepted: MLflow retries a dead server for minutes
            check_tracking_uri(tracking_uri)
        self.tags = dict(tags or {})
        self.run_id: Optional[str] = None  # checkpointed: a resume continues this run
        self._client: Any = None
        self._held = -1  # the latest step the store holds for this run (after a resume)

    def on_fit_start(self, view: TrainerView) -> None:
        require("mlflow", "mlflow")
        from mlflow import MlflowClient

        root = os.path.dirname(os.path.abspath(view.run_dir))
        os.makedirs(root, exist_ok=True)
        self._client = MlflowClient(self.tracking_uri or f"sqlite:///{root}/mlflow.db")
        if self.run_id is None:
            self._start(view, root)
        else:
            self._continue(view)

    def _start(self, view: TrainerView, root: str) -> None:
        from mlflow.entities import Param

        name = self.experiment or view.config.get("name") or "saferun"
        found = self._client.get_experiment_by_name(name)
        experiment = found.experiment_id if found is not None else self._client.create_experiment(
            name, artifact_location=f"file://{root}/mlartifacts")
        run = self._client.create_run(experiment, run_name=self.run_name or os.path.basename(
            os.path.abspath(view.run_dir)), tags={"saferun.run_dir": view.run_dir, **self.tags})
        self.run_id = run.info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in hparam_values(view.config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per call
            self._client.log_batch(self.run_id, params=params[i:i + 100])

    def _continue(self, view: TrainerView) -> None:
        assert self.run_id is not None
        try:
            run = self._client.get_run(self.run_id)
        except Exception as e:
            raise ConfigError(f"logger.mlflow: the checkpoint's MLflow run {self.run_id} is not "
                              f"in {self._client.tracking_uri} ({e}). Resume with the same "
                              f"logger.mlflow.tracking_uri.") from None
        self._held = max((m.step for key in run.data.metrics
                          for m in self._client.get_metric_history(self.run_id, key)), default=-1)
        changed = {k: v for k, v in hparam_values(view.config).items()
                   if k in run.data.params and run.data.params[k] != str(v)[:6000]}
        if changed:  # MLflow refuses to change a param: the run keeps the values it started with
            log.warning("MLflow run %s keeps its params; the resumed config differs in %s.",
                        self.run_id, ", ".join(sorted(changed)))
        self._client.update_run(self.run_id, status="RUNNING")

    def on_log(self, view: TrainerView, metrics: Mapping[str, float]) -> None:
        self._metrics(view.step, metrics)

    def on_validation_end(self, view: TrainerView, metrics: Mapping[str, float]) -> None:
        self._metrics(view.step, metrics)

    def _metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        if self._client is None or step <= self._held:
            return
        now = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step)
                                                     for k, v in metrics.items()])

    def on_media(self, view: TrainerView, media: Sequence[Media]) -> None:
        if self._client is None or view.step <= self._held:
            return
        for m in media:
            path = f"{m.kind}s/{m.name}/step_{m.step:08d}"
            if m.kind == "image":
                self._client.log_image(self.run_id, _image_hwc(m.value), key=m.name, step=m.step)
            elif m.kind == "histogram":
                self._client.log_dict(self.run_id, _histogram(m.value), path + ".json")
            else:
                self._client.log_text(self.run_id, m.value, path + ".txt")

    def on_fit_end(self, view: TrainerView, metrics: Mapping[str, float]) -> None:
        if self._client is None:
            return
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
        return {"run_id": self.run_id}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.run_id = state.get("run_id") or self.run_id


class WandbLogger(Callback):
    """Weights & Biases: metrics with their steps, the config, images, histograms and texts.
    Offline by default (<run_dir>/wandb/, upload later with `wandb sync`); online only with
    mode="online".

    Args:
        project: the W&B project; default: the config's `name`, else "saferun".
        mode: "offline" (default), "online" or "disabled".
        entity, name, tags: as wandb.init takes them.
    """

    def __init__(self, project: Optional[str] = None, mode: str = "offline",
                 entity: Optional[str] = None, name: Optional[str] = None,
                 tags: Optional[Sequence[str]] = None) -> None:
        if mode not in ("offline", "online", "disabled"):
            raise ConfigError(f"logger.wandb.mode is {mode!r}: offline, online or disabled.")
        self.project, self.mode, self.entity, self.name = project, mode, entity, name
        self.tags = list(tags or [])
        self.run_id: Optional[str] = None  # checkpointed: a resume continues this run
        self.sent = -1  # the latest step sent (checkpointed: after a resume, not sent again)
        self._run: Any = None
        self._wandb: Any = None
        self._held = -1  # after a resume: the latest step the interrupted run had sent
        self._sent_file = ""

    def on_fit_start(self, view: TrainerView) -> None:
        wandb = self._wandb = require("wandb", "wandb")
        os.makedirs(view.run_dir, exist_ok=True)
        self.run_id = self.run_id or uuid.uuid4().hex[:12]
        self._run = wandb.init(
            project=self.project or view.config.get("name") or "saferun", entity=self.entity,
            name=self.name or os.path.basename(os.path.abspath(view.run_dir)), tags=self.tags,
            id=self.run_id, resume="allow", mode=self.mode, dir=view.run_dir,
            config=dict(view.config), settings=wandb.Settings(silent=True))
        # The steps an interrupted run sent after its checkpoint: offline, W&B cannot say.
        self._sent_file = os.path.join(view.run_dir, "wandb", "saferun-sent-step")
        if os.path.isfile(self._sent_file):
            with open(self._sent_file) as f:
                self._held = max(self._held, int(f.read() or -1))

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
        if self._run is None or step < self.sent or step <= self._held:
            return
        self._run.log(row, step=step)
        if step != self.sent:
            with open(self._sent_file, "w") as f:
                f.write(str(step))
        self.sent = step

    def on_fit_end(self, view: TrainerView, metrics: Mapping[str, float]) -> None:
        if self._run is not None:
            self._run.summary.update(dict(metrics))
            self._run.finish()
            self._run = None

    def on_exception(self, view: TrainerView, exc: BaseException) -> None:
        if self._run is not None:
            self._run.finish(exit_code=1)
            self._run = None

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "sent": self.sent}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.run_id = state.get("run_id") or self.run_id
        self.sent = int(state.get("sent", -1))
