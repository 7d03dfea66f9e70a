"""What each component of a run holds, read back from its files the way a user reads them:
metrics.jsonl, TensorBoard's event files, the MLflow store through MlflowClient, W&B's offline
transaction log, the checkpoints, model_best.pt and model_ema.pt. Each view is plain data
(series {key: [(step, value)]}, tensors by name) that two runs compare with ==."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlparse

import torch

from saferun.checkpoint import list_checkpoints, load_checkpoint
from saferun.loggers.trackers import wandb_records

Series = dict[str, list[tuple[int, float]]]
SKIPPED = ("perf/", "time", "_")  # timings and the trackers' own bookkeeping


def _kept(key: str) -> bool:
    return not key.startswith(SKIPPED)


def jsonl_rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [{k: v for k, v in json.loads(line).items() if _kept(k) or k == "step"}
            for line in path.read_text().splitlines()]


def as_series(rows: list[dict[str, Any]]) -> Series:
    got: Series = {}
    for row in rows:
        for k, v in row.items():
            if k not in ("step", "epoch") and isinstance(v, (int, float)):
                got.setdefault(k, []).append((row["step"], float(v)))
    return got


def jsonl(run_dir: Path) -> Series:
    return as_series(jsonl_rows(run_dir))


def tensorboard(run_dir: Path) -> tuple[Series, dict[str, list[Any]]]:
    """(scalars, media): images, histograms and texts as TensorBoard's server reads them."""
    from tensorboard.backend.event_processing import plugin_event_accumulator
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = str(run_dir / "tensorboard")
    acc = EventAccumulator(folder, size_guidance={"scalars": 0, "images": 0, "histograms": 0})
    acc.Reload()
    tags = acc.Tags()
    scalars = {t: [(e.step, float(e.value)) for e in acc.Scalars(t)] for t in tags["scalars"]
               if _kept(t)}
    media: dict[str, list[Any]] = {
        t: [(e.step, e.encoded_image_string) for e in acc.Images(t)] for t in tags["images"]}
    media.update({t: [(e.step, e.histogram_value.num, e.histogram_value.sum)
                      for e in acc.Histograms(t)] for t in tags["histograms"]})
    served = plugin_event_accumulator.EventAccumulator(folder, size_guidance={"tensors": 0})
    served.Reload()
    media.update({t: [(e.step, e.tensor_proto.string_val[0]) for e in served.Tensors(t)]
                  for t in served.Tags()["tensors"]
                  if t.endswith("text_summary") and not t.startswith("config")})
    return scalars, media


# ------------------------------------------------------------------ MLflow

def mlflow_client(root: Path) -> Any:
    from mlflow import MlflowClient

    return MlflowClient(f"sqlite:///{root}/mlflow.db")  # the default store: beside the runs


def mlflow_runs(run_dir: Path) -> list[Any]:
    """The MLflow runs started for `run_dir`, oldest first."""
    client = mlflow_client(run_dir.parent)
    experiment = client.get_experiment_by_name("grid")
    if experiment is None:
        return []
    runs = client.search_runs([experiment.experiment_id],
                              filter_string=f"tags.`saferun.run_dir` = '{run_dir}'")
    return sorted(runs, key=lambda r: r.info.start_time)


def mlflow_series(run_dir: Path, run: Any) -> Series:
    client = mlflow_client(run_dir.parent)
    return {k: [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, k),
                                                  key=lambda m: (m.step, m.timestamp))]
            for k in run.data.metrics if _kept(k)}


def mlflow_media(run: Any) -> dict[str, list[str]]:
    """The run's media artifacts: {kind/name: sorted file contents (images: their names)}."""
    root = Path(urlparse(run.info.artifact_uri).path)
    got: dict[str, list[str]] = {}
    for kind in ("texts", "histograms", "images"):
        for path in sorted((root / kind).rglob("*")) if (root / kind).is_dir() else []:
            if not path.is_file() or kind == "images" and path.suffix != ".png":
                continue
            name = str(path.parent.relative_to(root))
            if kind == "images":  # train~grid+step+3+timestamp+...png: the key, the step
                key, _, step, *_ = path.stem.split("+")
                got.setdefault(f"images/{key.replace('~', '/')}", []).append(f"step {int(step):08d}")
            else:
                got.setdefault(name, []).append(path.read_text())
    return {k: sorted(v) for k, v in got.items()}


# ------------------------------------------------------------------ W&B offline

def wandb_runs(run_dir: Path) -> dict[str, list[tuple[int, dict[str, Any]]]]:
    """{W&B run id: [(step, {key: value})]} from every offline run under <run_dir>/wandb and the
    folders a course change or a fresh start set aside; media keys keep their type only."""
    from wandb.proto import wandb_internal_pb2

    got: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for path in sorted(run_dir.glob("**/wandb/offline-run-*/run-*.wandb")):
        rows = got.setdefault(path.stem.removeprefix("run-"), [])
        for raw in wandb_records(path.read_bytes()):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            if record.WhichOneof("record_type") != "history":
                continue
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in record.history.item}
            row = {k: (v if isinstance(v, (int, float)) else
                       v.get("_type") if isinstance(v, dict) else type(v).__name__)
                   for k, v in items.items() if _kept(k)}
            rows.append((int(items["_step"]), row))
    return got


def wandb_series(rows: list[tuple[int, dict[str, Any]]]) -> Series:
    got: Series = {}
    for step, row in rows:
        for k, v in row.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                got.setdefault(k, []).append((step, float(v)))
    return got


# ------------------------------------------------------------------ checkpoints and weights

def final_checkpoint(run_dir: Path) -> Optional[dict[str, Any]]:
    found = list_checkpoints(run_dir / "checkpoints")
    return load_checkpoint(found[-1]) if found else None


def weights(path: Path) -> Optional[dict[str, torch.Tensor]]:
    return torch.load(path, weights_only=True) if path.is_file() else None


def callback_state(state: dict[str, Any], name: str) -> Any:
    # "n:Class" or "n:Class(state_key)" (EarlyStopping: its monitor)
    (key,) = [k for k in state["callbacks"] if k.split(":", 1)[1].split("(")[0] == name]
    return state["callbacks"][key]


def all_finite(value: Any) -> bool:
    """Whether every floating tensor in a (nested) state is finite."""
    if isinstance(value, torch.Tensor):
        return not value.is_floating_point() or bool(torch.isfinite(value).all())
    if isinstance(value, dict):
        return all(all_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(all_finite(v) for v in value)
    return True


def saved_steps(run_dir: Path) -> list[int]:
    return [int(p.name.split("-")[1].split(".")[0]) for p in list_checkpoints(run_dir / "checkpoints")]


def load_checkpoint_at(run_dir: Path, step: int) -> dict[str, Any]:
    (path,) = [p for p in list_checkpoints(run_dir / "checkpoints") if p.name == f"step-{step:08d}"]
    return load_checkpoint(path)


def tensor_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"
    if not a.is_floating_point():
        return f"{int(a.ne(b).sum())} of {a.numel()} values differ"
    return (f"{int((a != b).sum())} of {a.numel()} values differ (max abs diff "
            f"{(a.double() - b.double()).abs().max().item():.3g})")
