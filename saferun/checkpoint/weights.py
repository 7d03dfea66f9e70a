"""A finished run's weights: model.pt (the last), model_best.pt (trainer.save_best's best), a
checkpoint; which file a `checkpoint=` argument names, the run's saved config, and loading the
weights into a model with the mismatch named (`Trainer.from_run`, `saferun.load_model`,
`saferun test`).

Each weights file of a run directory (model.pt, model_best.pt, their model_ema*.pt) has a
record in the run's summary.json under "weights": its size and SHA-256, the step and epoch
its weights are from (model_best.pt: also the metric and value; summary.json's "best" is
written with it). A reader verifies the file against its record, so a flipped bit is refused
as a checkpoint's is. The record and the file cannot be replaced in one atomic step, so the
new record is written first as "weights_pending", then the file is renamed into place, then
the record moves to "weights" (with "best"): after a kill at any point the file matches one
of the two records, and the reader takes the one it matches.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import secrets
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
from torch import nn

from ..errors import SaferunError
from .rundir import update_summary
from .intent import fsync_dir
from .store import (LOCAL, CheckpointError, Storage, _write_failure, checkpoint_root, list_checkpoints,
                    load_checkpoint, read_manifest, write_tensor_file)

FILES = {"best": "model_best.pt", "last": "model.pt"}  # checkpoint= names -> the exported file
EMA_FILES = {"best": "model_ema_best.pt", "last": "model_ema.pt"}
RECORDS, PENDING = "weights", "weights_pending"  # summary.json: {file name: its record}


@dataclasses.dataclass(frozen=True)
class Best:
    """trainer.save_best's best validation so far (`Trainer.best`, summary.json's "best").

    metric: the watched metric (trainer.save_best); value: its best value; step: the step of
    that validation; path: <run_dir>/model_best.pt, its weights; checkpoint: the checkpoint
    saved at that step ("" when a change of course left it in another run directory)."""

    metric: str
    value: float
    step: int
    path: str
    checkpoint: str


def saved_config(run_dir: str | Path) -> dict[str, Any]:
    """The config a run saved in <run_dir>/config.yaml, as plain data."""
    import yaml

    where = Path(run_dir)
    if not where.is_dir():
        raise SaferunError(f"the run directory {where} does not exist (or is not a directory). "
                           f"Name a run directory a fit() wrote, e.g. runs/<name>/<date>.")
    path = where / "config.yaml"
    if not path.is_file():
        raise SaferunError(f"{where} holds no config.yaml, so it is not a run directory (fit() "
                           f"writes config.yaml when a run starts). Name the run directory "
                           f"itself, not its checkpoints/ or a parent.")
    return yaml.safe_load(path.read_text())


@dataclasses.dataclass
class Weights:
    """What `checkpoint=` named: the model's weights, the averaged ones (trainer.ema) if the
    run kept them, the step they are from (None: unknown) and where they came from."""

    model: Mapping[str, torch.Tensor]
    ema: Optional[Mapping[str, torch.Tensor]]
    step: Optional[int]
    source: Path
    state: Optional[Mapping[str, Any]] = None  # a checkpoint directory's whole state
    epoch: Optional[int] = None
    sha256: str = ""  # of the file (a checkpoint directory: of its state.pt)

    def provenance(self, run_dir: str | Path) -> dict[str, Any]:
        """What an evaluation of these weights records: the source run, the file, its step,
        epoch and SHA-256 (summary.json's "tested", the log)."""
        return {"run": str(Path(run_dir).resolve()), "checkpoint": str(self.source.resolve()),
                "step": self.step, "epoch": self.epoch, "sha256": self.sha256}


def publish_weights(run_dir: str | Path, files: Mapping[str, Mapping[str, torch.Tensor]],
                    record: Mapping[str, Any], summary: Mapping[str, Any] = {}) -> None:
    """Write the weights `files` ({name: state_dict}) into `run_dir`, each with `record` (step,
    epoch, ...) and its digest in summary.json, crash-consistently (see the module's doc);
    `summary`: more summary.json entries that go with them (model_best.pt's "best")."""
    run = Path(run_dir)
    temps = {name: run / f".tmp-{name}-{secrets.token_hex(4)}" for name in files}
    try:
        entries = {name: {**write_tensor_file(temps[name], sd), **record} for name, sd in files.items()}
        update_summary(str(run), {PENDING: {**_summary(run).get(PENDING, {}), **entries}})
        for name in files:
            os.replace(temps[name], run / name)
        fsync_dir(run)
        now = _summary(run)
        update_summary(str(run), {RECORDS: {**now.get(RECORDS, {}), **entries},
                             PENDING: {k: v for k, v in now.get(PENDING, {}).items() if k not in files},
                             **summary})
    except (OSError, RuntimeError) as e:
        raise CheckpointError(_write_failure(run / next(iter(files)), e)) from None
    finally:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)


def _summary(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "summary.json"
    try:
        summary = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError as e:
        raise CheckpointError(f"{path} is unreadable ({e}): it holds the digests of the run's "
                              f"weights files.") from None
    return summary if isinstance(summary, dict) else {}


def recorded(path: Path) -> list[dict[str, Any]]:
    """The records summary.json holds for the weights file `path` (written, then pending)."""
    summary = _summary(path.parent)
    found = [summary.get(key, {}).get(path.name) for key in (RECORDS, PENDING)]
    return [r for r in found if isinstance(r, dict)]


def load_verified(path: Path) -> tuple[Mapping[str, torch.Tensor], dict[str, Any]]:
    """A run's weights file (model.pt, model_best.pt, ...) and the record it matches, after
    checking its size and SHA-256; refused when it matches none."""
    data = path.read_bytes()  # read once: what is hashed is what is loaded
    size, digest = len(data), hashlib.sha256(data).hexdigest()
    records = recorded(path)
    record = next((r for r in records if (r.get("bytes"), r.get("sha256")) == (size, digest)), None)
    if record is None and not records:
        raise CheckpointError(
            f"{path} has no digest recorded in {path.parent / 'summary.json'} (a run directory's "
            f"weights files are written with one), so it cannot be verified. If you trust the "
            f"file, name it as a file of weights: checkpoint={path} (loaded unverified).")
    if record is None:
        said = "; ".join(f"{r.get('bytes')} bytes, sha256 {r.get('sha256')}" for r in records)
        raise CheckpointError(
            f"{path} does not match the digest recorded for it in summary.json (corrupted or "
            f"replaced: {size} bytes, sha256 {digest}; recorded: {said}). Use a checkpoint "
            f"directory instead (verified by its manifest), e.g. the one of that step.")
    return _load_file(path, data), {**record, "sha256": digest}


def check_out_dir(run_dir: str | Path, out_dir: Optional[str]) -> None:
    """from_run's `out_dir` (where test() writes its metrics) must be neither the run it reads
    nor a directory that holds another run's logs: its metrics.jsonl, summary.json and
    TensorBoard would get this evaluation's lines mixed in."""
    if out_dir is None:
        return
    where = Path(out_dir)
    if where.resolve() == Path(run_dir).resolve():
        raise SaferunError(f"out_dir={out_dir} is the run directory being read: test() would "
                           f"add its lines to that run's metrics.jsonl, summary.json and "
                           f"TensorBoard. Name a new directory (or leave out_dir unset: a new "
                           f"one under runs/).")
    held = [name for name in ("metrics.jsonl", "summary.json", "checkpoints")
            if (where / name).exists()]
    if held:
        raise SaferunError(f"out_dir={out_dir} holds another run's {', '.join(held)}: test() "
                           f"would mix this evaluation into that run's logs. Name a new "
                           f"directory (or leave out_dir unset: a new one under runs/).")


def find_weights(run_dir: str | Path, checkpoint: str, config: Mapping[str, Any],
                 storage: Storage = LOCAL) -> Weights:
    """The weights `checkpoint` names in `run_dir`: "best" (model_best.pt), "last" (model.pt),
    a checkpoint directory (<run_dir>/checkpoints/step-N, in `storage`) or a .pt file of
    weights."""
    where = Path(run_dir)
    if checkpoint in FILES:
        path = where / FILES[checkpoint]
        if not path.is_file():
            raise SaferunError(_missing(where, checkpoint, config, storage))
        model, record = load_verified(path)
        ema = where / EMA_FILES[checkpoint]
        return Weights(model, load_verified(ema)[0] if ema.is_file() else None,
                       record.get("step"), path, epoch=record.get("epoch"), sha256=record["sha256"])
    path = Path(checkpoint)
    if storage.isfile(path / "manifest.json"):
        state = load_checkpoint(path, storage=storage)
        if "sharded" in state:
            raise CheckpointError(
                f"checkpoint={checkpoint} holds the weights sharded by trainer.strategy=fsdp; "
                f"use checkpoint=best or checkpoint=last (whole weights, model_best.pt or "
                f"model.pt).")
        return Weights(state["model"], None, state["loop"]["step"], path, state,
                       state["loop"]["epoch"], read_manifest(path, storage)["state.pt"]["sha256"])
    if path.is_file():  # a file the user names: loaded as it is, its digest recorded
        data = path.read_bytes()
        return Weights(_load_file(path, data), None, None, path,
                       sha256=hashlib.sha256(data).hexdigest())
    what = ("does not exist" if not path.exists() else
            "is neither a file nor a checkpoint directory (it has no manifest.json)")
    raise SaferunError(
        f"checkpoint={checkpoint!r} {what}: name best (model_best.pt), last (model.pt), a "
        f"checkpoint directory (<run dir>/checkpoints/step-N) or a .pt file of weights.")


def _missing(where: Path, checkpoint: str, config: Mapping[str, Any], storage: Storage) -> str:
    trainer = config.get("trainer") or {}
    found = list_checkpoints(checkpoint_root(where), storage)
    latest = f" (the latest: checkpoint={found[-1]})" if found else ""
    if checkpoint == "best" and not trainer.get("save_best"):
        return (f"{where} has no model_best.pt: the run did not set trainer.save_best, so it kept "
                f"no best model. Set trainer.save_best to a validation metric (e.g. "
                f"trainer.save_best=val/acc trainer.save_best_mode=max) when training; for this "
                f"run use checkpoint=last (model.pt) or a checkpoint directory{latest}.")
    best = _summary(where).get("best")
    if checkpoint == "best" and (isinstance(best, dict) or FILES["best"] in _summary(where).get(RECORDS, {})):
        named = (f" ({best.get('metric')} {best.get('value')} at step {best.get('step')})"
                 if isinstance(best, dict) else "")
        return (f"{where} has no model_best.pt, although its summary.json records a best"
                f"{named}: the file was moved or deleted. Use that step's checkpoint directory "
                f"if it is kept{latest}, or checkpoint=last.")
    if checkpoint == "best":
        return (f"{where} has no model_best.pt although trainer.save_best="
                f"{trainer.get('save_best')}: no validation has reported a finite value yet. "
                f"Use checkpoint=last or a checkpoint directory{latest}.")
    return (f"{where} has no model.pt: it is written when fit() ends, and this run has not "
            f"ended (or crashed). Name a checkpoint instead{latest}, or checkpoint=best.")


def _load_file(path: Path, data: bytes) -> Mapping[str, torch.Tensor]:
    try:
        weights = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(unreadable_weights(path, e)) from None
    if not isinstance(weights, Mapping):
        raise CheckpointError(f"{path} holds a {type(weights).__name__}, not a state_dict of "
                              f"weights.")
    return weights


def unreadable_weights(path: Path, error: Exception) -> str:
    """Why torch.load(weights_only=True) refused `path`, without torch's advice to retry with
    weights_only=False: that runs code from the file, and does not mend a damaged one."""
    import re

    pickled = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(error))
    if pickled:  # torch.save(model): the object pickled whole, its class by name
        return (f"{path} holds a pickled object ({pickled.group(1)}), not a state_dict of "
                f"weights: it was saved with torch.save(model). Save the weights with "
                f"torch.save(model.state_dict(), PATH) (loading a whole pickle would run code "
                f"from the file).")
    reason = str(error).split(". ")[0].strip() or type(error).__name__
    return (f"{path} is not a readable weights file: damaged, cut short or not written by "
            f"torch.save ({type(error).__name__}: {reason}). Name model_best.pt, model.pt, "
            f"another .pt file of weights (torch.save(model.state_dict(), PATH)) or a checkpoint "
            f"directory.")


def load_weights(model: nn.Module, weights: Mapping[str, torch.Tensor], source: Any) -> None:
    """Load `weights` into `model`, strictly; a mismatch names the keys and shapes."""
    own = model.state_dict()
    missing = sorted(set(own) - set(weights))
    unexpected = sorted(set(weights) - set(own))
    shapes = sorted(f"{k} {tuple(weights[k].shape)} vs the model's {tuple(own[k].shape)}"
                    for k in set(own) & set(weights)
                    if isinstance(weights[k], torch.Tensor) and weights[k].shape != own[k].shape)
    if missing or unexpected or shapes:
        said = [f"{what}: {', '.join(keys[:8])}{' ...' if len(keys) > 8 else ''}"
                for what, keys in (("missing from the weights", missing),
                                   ("not in the model", unexpected),
                                   ("of another shape", shapes)) if keys]
        raise CheckpointError(f"the weights in {source} do not fit this model ({type(model).__name__}"
                              f"): {'; '.join(said)}. Build the model the run was trained with "
                              f"(its config.yaml), or name the right checkpoint.")
    model.load_state_dict(weights)


def load_model(run_dir: str | Path, checkpoint: str = "best") -> nn.Module:
    """The model of a command-line (Hydra) run: its config's `model` node instantiated, with
    the weights `checkpoint` names ("best": model_best.pt, "last": model.pt, or a path), in
    eval mode, on the CPU."""
    from ..loop.components import instantiate_node

    config = saved_config(run_dir)
    node = config.get("model")
    if not node:
        raise SaferunError(
            f"the config of {run_dir} has no model node: its Trainer builds the model in "
            f"build_model(). Use that class instead: "
            f"YourTrainer.from_run({str(run_dir)!r}, checkpoint={checkpoint!r}).model.")
    weights = find_weights(run_dir, checkpoint, config)
    model = instantiate_node("model", node)
    load_weights(model, weights.model, weights.source)
    return model.eval()
