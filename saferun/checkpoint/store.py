"""Crash-safe checkpoints: atomic writes, hashed manifests, safe loading.

A checkpoint is a directory `<run_dir>/checkpoints/step-NNNNNNNN/` holding
`state.pt` and `manifest.json`. It is written under a temporary name, each
file flushed and fsynced, the manifest (with each file's SHA-256) written
last, then the directory is renamed into place and its parent fsynced. So a
directory named `step-*` with a manifest whose hashes match is complete; a
process killed mid-save leaves only a `.tmp-*` directory, which is ignored.

Loading uses `torch.load(weights_only=True)`: tensors and plain containers
only, so a crafted file cannot run code. saferun keeps every saved value to
that (the config is stored as plain data, NumPy RNG state as a tensor).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import re
import secrets
import shutil
from pathlib import Path
from typing import Any, Iterable, Optional

import torch

from ..errors import SaferunError

log = logging.getLogger("saferun")

FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


class CheckpointError(SaferunError):
    """A checkpoint is missing, incomplete, corrupted or unsafe to load."""


def checkpoint_root(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(root: Path, step: int, state: dict[str, Any]) -> Path:
    """Write `state` atomically as checkpoint `step` under `root`; return its directory."""
    check_plain(state)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        files = {"state.pt": _write_tensor_file(tmp / "state.pt", state)}
        manifest = {"format": FORMAT_VERSION, "step": step, "files": files}
        _write_bytes(tmp / "manifest.json", json.dumps(manifest, indent=2).encode())
        _fsync_dir(tmp)
        old = None
        if final.exists():  # a re-save of the same step replaces it; older ones stay meanwhile
            old = root / f".tmp-old-{secrets.token_hex(4)}"
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def save_weights(path: Path, state_dict: dict[str, torch.Tensor]) -> None:
    """Write a plain state_dict atomically (loadable with torch.load(weights_only=True))."""
    tmp = path.with_name(f".tmp-{path.name}-{secrets.token_hex(4)}")
    try:
        _write_tensor_file(tmp, state_dict)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def load_checkpoint(path: Path, map_location: Any = "cpu") -> dict[str, Any]:
    """Verify `path`'s manifest and hashes, then load its state with weights_only=True."""
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise CheckpointError(f"{path} has no manifest.json: it is not a complete saferun "
                              f"checkpoint (a save was interrupted?).")
    try:
        manifest = json.loads(manifest_path.read_text())
        expected = manifest["files"]["state.pt"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{manifest_path} is unreadable ({e}).") from None
    state_path = path / "state.pt"
    actual = _sha256(state_path) if state_path.is_file() else None
    if actual != expected["sha256"]:
        raise CheckpointError(f"{state_path} does not match its manifest (truncated or "
                              f"corrupted: sha256 {actual} != {expected['sha256']}).")
    try:
        return torch.load(state_path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        reason = next((line.strip() for line in str(e).splitlines() if "Unsupported" in line),
                      str(e).splitlines()[0])
        raise CheckpointError(
            f"refused to load {state_path}: it holds objects other than tensors and plain "
            f"containers, which could run code when unpickled ({reason}). saferun never "
            f"writes such files; do not load it unless you made it yourself."
        ) from None


_PLAIN = (str, int, float, bool, type(None), torch.Tensor, torch.dtype, torch.Size)


def check_plain(obj: Any, path: str = "state") -> None:
    """Raise `CheckpointError` naming the first value `torch.load(weights_only=True)` would refuse.

    Checked before writing, so that a checkpoint that could not be loaded back is never saved.
    """
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                raise CheckpointError(f"{path} has a key of type {type(k).__name__}; use str keys.")
            check_plain(v, f"{path}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        if type(obj) not in (list, tuple):
            raise CheckpointError(f"{path} is a {type(obj).__name__}; save a plain list or tuple.")
        for i, v in enumerate(obj):
            check_plain(v, f"{path}[{i}]")
    elif type(obj) not in _PLAIN and not isinstance(obj, torch.Tensor):
        raise CheckpointError(
            f"{path} is a {type(obj).__module__}.{type(obj).__name__}, which a safe load "
            f"(weights_only=True) refuses. Keep checkpoint state to tensors, numbers, strings and "
            f"lists/dicts of them (a callback's state_dict included).")


def list_checkpoints(root: Path) -> list[Path]:
    """Complete-looking checkpoint directories under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def load_latest(root: Path, map_location: Any = "cpu") -> Optional[tuple[Path, dict[str, Any]]]:
    """The newest checkpoint under `root` that verifies, with its state; None if there is none.

    A newer checkpoint that fails verification is skipped with a warning naming it.
    """
    for path in reversed(list_checkpoints(root)):
        try:
            return path, load_checkpoint(path, map_location)
        except CheckpointError as e:
            log.warning("Skipping checkpoint %s: %s Falling back to an older one.", path, e)
    return None


def rotate(root: Path, keep_last: int, keep: Iterable[Path] = ()) -> None:
    """Delete all but the newest `keep_last` checkpoints (and those in `keep`), and stale temps."""
    kept = {p.resolve() for p in keep}
    for path in list_checkpoints(root)[:-keep_last]:
        if path.resolve() not in kept:
            shutil.rmtree(path, ignore_errors=True)
    for tmp in root.glob(".tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)


def _write_tensor_file(path: Path, obj: Any) -> dict[str, Any]:
    """torch.save to `path`, flushed and fsynced; returns its size and SHA-256."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
