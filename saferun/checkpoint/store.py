"""Crash-safe checkpoints: atomic writes, hashed manifests, safe loading.

A checkpoint is a directory `<run_dir>/checkpoints/step-NNNNNNNN/` holding
`state.pt` and `manifest.json` (sharded: also each rank's files, see `sharded.py`).
It is written under a temporary name, each file flushed and fsynced, the manifest
(with each file's SHA-256) written last, then the directory is renamed into place and
its parent fsynced. So a directory named `step-*` with a manifest whose hashes match is
complete; a process killed mid-save leaves only a `.tmp-*` directory, which is ignored.

Saving a step that already has a checkpoint (the final save at a save step, a
stop right after one) renames the old copy to `step-N.replaced-XXXX` before the
new one takes its name, and deletes it only after: a crash between the two
renames leaves the old copy, which is still listed and loaded, never nothing.

Loading uses `torch.load(weights_only=True)`: tensors and plain containers
only, so a crafted file cannot run code. saferun keeps every saved value to
that (the config is stored as plain data, NumPy RNG state as a tensor).

Every file operation on checkpoints goes through a `Storage` (the protocol below): `LocalStorage`
holds the local filesystem's code (fsync, atomic rename); another backend is one class. The
functions here take the storage to use (`LOCAL` by default); the Checkpointer holds the run's.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import pickle
import re
import resource
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterable, Iterator, Optional, Protocol

import torch

from .. import distributed
from ..errors import CheckpointError
from .intent import fsync_dir

log = logging.getLogger("saferun")

# 2: each rank's epoch_start and spike detectors, and a stop's owed step end, always present
# (format 1 was written only by development versions before 0.1.0)
FORMAT_VERSION = 2
# step-NNNNNNNN, or step-NNNNNNNN.replaced-XXXX: the previous copy of a step being saved again.
_STEP_DIR = re.compile(r"^step-(\d{8,})(\.replaced-[0-9a-f]+)?$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_SHARD_FILE = re.compile(r"^(\.metadata|__\d+_\d+\.distcp)$")


class Storage(Protocol):
    """Where checkpoints are kept: the file operations saving, loading, listing and rotating
    them need. Paths are `Path`s in the storage's namespace."""

    def isdir(self, path: Path) -> bool: ...
    def isfile(self, path: Path) -> bool: ...
    def listdir(self, path: Path) -> list[str]:
        """The names in directory `path`."""
    def remove(self, path: Path) -> None:
        """Delete file or directory `path` with what it holds; nothing if it is not there."""
    def makedirs(self, path: Path) -> None:
        """Directory `path` and its parents (those there already are fine)."""
    def open_read(self, path: Path) -> Any:
        """A context manager: file `path` opened for reading bytes."""
    def open_write(self, path: Path) -> Any:
        """A context manager: file `path` opened for writing bytes, durable once it closes."""
    def modified(self, path: Path) -> float:
        """When `path` was last written (seconds since the epoch)."""
    def publish(self, tmp: Path, final: Path) -> None:
        """Put completed directory `tmp` in place as `final` atomically, durably: a crash
        leaves the old `final` (if any) or the new one, never neither or a part of one."""


class LocalStorage:
    """The local filesystem: writes fsynced, `publish` a rename with the parent fsynced."""

    def isdir(self, path: Path) -> bool:
        return path.is_dir()

    def isfile(self, path: Path) -> bool:
        return path.is_file()

    def listdir(self, path: Path) -> list[str]:
        return [p.name for p in path.iterdir()]

    def remove(self, path: Path) -> None:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)

    def makedirs(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)

    def open_read(self, path: Path) -> IO[bytes]:
        return open(path, "rb")

    @contextmanager
    def open_write(self, path: Path) -> Iterator[IO[bytes]]:
        with open(path, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())

    def modified(self, path: Path) -> float:
        return path.stat().st_mtime

    def publish(self, tmp: Path, final: Path) -> None:
        fsync_dir(tmp)
        old = None
        if final.exists():  # saved again: the old copy keeps a listed name until the new one is in
            old = final.with_name(f"{final.name}.replaced-{secrets.token_hex(4)}")
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


LOCAL: Storage = LocalStorage()


def checkpoint_root(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(root: Path, step: int, state: dict[str, Any], storage: Storage = LOCAL) -> Path:
    """Write `state` atomically as checkpoint `step` under `root`; return its directory.

    Raises `CheckpointError` naming the checkpoint and the cause when it cannot be written
    (a full disk, a file size limit, a permission change); the checkpoints already there stay.
    """
    check_plain(state)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}-{secrets.token_hex(4)}"
    try:
        storage.makedirs(tmp)
        written = write_tensor_file(tmp / "state.pt", state, storage)
        return publish(tmp, final, step, {"state.pt": written}, storage)
    except BaseException as e:
        storage.remove(tmp)
        if isinstance(e, (OSError, RuntimeError)):
            raise CheckpointError(_write_failure(final, e)) from None
        raise


def publish(tmp: Path, final: Path, step: int, files: dict[str, Any],
            storage: Storage = LOCAL) -> Path:
    """Complete `tmp`, its `files` written and durable: the manifest last, then `tmp` is put
    in place as `final` (`Storage.publish`: a step saved again keeps its old copy listed
    under a `.replaced-` name until the new one is in)."""
    with storage.open_write(tmp / "manifest.json") as f:
        f.write(json.dumps({"format": FORMAT_VERSION, "step": step, "files": files}, indent=2).encode())
    storage.publish(tmp, final)
    return final


def save_weights(path: Path, state_dict: dict[str, torch.Tensor]) -> None:
    """Write a plain state_dict atomically (loadable with torch.load(weights_only=True))."""
    tmp = path.with_name(f".tmp-{path.name}-{secrets.token_hex(4)}")
    try:
        write_tensor_file(tmp, state_dict)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except (OSError, RuntimeError) as e:
        raise CheckpointError(_write_failure(path, e)) from None
    finally:
        tmp.unlink(missing_ok=True)


def load_checkpoint(path: Path, map_location: Any = "cpu", storage: Storage = LOCAL) -> dict[str, Any]:
    """Verify `path`'s manifest and hashes, then load its state with weights_only=True."""
    if not storage.isfile(path / "manifest.json"):
        raise CheckpointError(f"{path} has no manifest.json: it is not a complete saferun "
                              f"checkpoint (a save was interrupted?).")
    for name, expected in read_manifest(path, storage).items():  # state.pt, and any shard files
        file = path / name
        try:
            size, actual = file_digest(file, storage)
        except OSError as e:
            raise CheckpointError(f"{file} is unreadable ({e.strerror or e}).") from None
        if (size, actual) != (expected["bytes"], expected["sha256"]):
            raise CheckpointError(f"{file} does not match its manifest (truncated or "
                                  f"corrupted: {size} bytes, sha256 {actual}; the manifest says "
                                  f"{expected['bytes']} bytes, sha256 {expected['sha256']}).")
    state_path = path / "state.pt"
    try:
        with storage.open_read(state_path) as f:
            state = torch.load(f, map_location=map_location, weights_only=True)
        if isinstance(state, dict) and isinstance(state.get("sharded"), dict):  # sharded.py's
            state["sharded"]["path"] = str(path)
        return state
    except pickle.UnpicklingError as e:
        reason = next((line.strip() for line in str(e).splitlines() if "Unsupported" in line),
                      str(e).splitlines()[0])
        raise CheckpointError(
            f"refused to load {state_path}: it holds objects other than tensors and plain "
            f"containers, which could run code when unpickled ({reason}). saferun never "
            f"writes such files; do not load it unless you made it yourself."
        ) from None


def read_manifest(path: Path, storage: Storage = LOCAL) -> dict[str, dict[str, Any]]:
    """The manifest's file entries (state.pt, and a sharded checkpoint's shard files), once
    every field has the shape saferun writes.

    A damaged manifest (a flipped bit in a key or a value) must make the checkpoint
    count as damaged, never crash the resume with a KeyError or TypeError.
    """
    manifest_path = path / "manifest.json"
    try:
        with storage.open_read(manifest_path) as f:
            manifest = json.loads(f.read())
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{manifest_path} is unreadable ({e}).") from None
    problem = _manifest_problem(manifest, path.name)
    if problem is not None and isinstance(manifest, dict) and manifest.get("format") == 1 and \
            _manifest_problem({**manifest, "format": FORMAT_VERSION}, path.name) is None:
        raise CheckpointError(
            f"{path} was written in checkpoint format 1, by a development version of saferun "
            f"before 0.1.0; this saferun reads format {FORMAT_VERSION} only. Finish that run with "
            f"the saferun that wrote it, or start over with resume=fresh (its files are moved "
            f"aside, nothing is deleted).")
    if problem is not None:
        raise CheckpointError(f"{manifest_path} is damaged: {problem}.")
    return manifest["files"]


def _manifest_problem(manifest: Any, dir_name: str) -> Optional[str]:
    """What in `manifest` differs from the shape save_checkpoint writes, or None."""
    if not isinstance(manifest, dict) or set(manifest) != {"format", "step", "files"}:
        return "it is not an object with exactly the keys format, step, files"
    if not _is_int(manifest["format"]) or manifest["format"] != FORMAT_VERSION:
        return f"format is {manifest['format']!r}, not {FORMAT_VERSION}"
    named = _STEP_DIR.match(dir_name)
    if not _is_int(manifest["step"]) or (named and int(named.group(1)) != manifest["step"]):
        return f"step {manifest['step']!r} does not match the directory name {dir_name}"
    files = manifest["files"]
    if not isinstance(files, dict) or "state.pt" not in files:
        return "files is not an object with the key state.pt"
    shards = set(files) - {"state.pt"}
    if shards and (".metadata" not in shards or not all(map(_SHARD_FILE.match, shards))):
        return "files holds other keys than state.pt, .metadata and __<rank>_<n>.distcp"
    for name, entry in files.items():
        if not isinstance(entry, dict) or set(entry) != {"bytes", "sha256"}:
            return f"files.{name} is not an object with exactly the keys bytes, sha256"
        if not _is_int(entry["bytes"]):
            return f"files.{name}.bytes is not a size"
        if not isinstance(entry["sha256"], str) or not _SHA256.match(entry["sha256"]):
            return f"files.{name}.sha256 is not a SHA-256 in hex"
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


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


def list_checkpoints(root: Path, storage: Storage = LOCAL) -> list[Path]:
    """Complete-looking checkpoint directories under `root`, oldest first.

    A `step-N.replaced-*` copy (left by a crash while step N was saved again) sorts just
    before `step-N`, so it is used only when `step-N` is missing or damaged.
    """
    if not storage.isdir(root):
        return []
    found = [(int(m.group(1)), m.group(2) is None, root / name) for name in storage.listdir(root)
             if (m := _STEP_DIR.match(name)) and storage.isdir(root / name)]
    return [p for _, _, p in sorted(found)]


def load_latest(root: Path, map_location: Any = "cpu",
                storage: Storage = LOCAL) -> Optional[tuple[Path, dict[str, Any]]]:
    """The newest checkpoint under `root` that verifies, with its state; None if there is none.

    A newer checkpoint that fails verification is skipped with a warning naming it. When
    there are checkpoints but none verifies, `CheckpointError` lists them: starting over
    instead would silently throw the run away.
    """
    damaged = []
    for path in reversed(list_checkpoints(root, storage)):
        try:
            return path, load_checkpoint(path, map_location, storage)
        except CheckpointError as e:
            log.warning("Skipping checkpoint %s: %s Falling back to an older one.", path, e)
            damaged.append(f"  - {path.name}: {e}")
    if damaged:
        raise CheckpointError(
            f"every checkpoint in {root} is damaged, so nothing was loaded:\n"
            + "\n".join(damaged) + "\nTo resume from a good copy elsewhere, set resume=PATH. To "
            "start over on purpose, set resume=fresh (they are moved aside, nothing deleted), "
            "or use another run directory.")
    return None


def rotate(root: Path, keep_last: int, keep: Iterable[Path] = (),
           current: Optional[Path] = None, storage: Storage = LOCAL) -> None:
    """Delete all but the newest `keep_last` checkpoints (and those in `keep`), and stale temps.

    With `current` (the checkpoint just saved), checkpoints of later steps are left alone
    and not counted: they can only be damaged ones a resume fell back past, and counting
    them would delete the good new ones.
    """
    kept = {p.resolve() for p in keep}
    limit = step_of(current) if current is not None else math.inf
    found = [p for p in list_checkpoints(root, storage) if step_of(p) <= limit]
    whole = {step_of(p) for p in found if ".replaced-" not in p.name}
    # a replaced copy is redundant once its step was saved again in full
    redundant = [p for p in found if ".replaced-" in p.name and step_of(p) in whole]
    listed = [p for p in found if p not in redundant]
    for path in redundant + listed[:-keep_last]:
        if path.resolve() not in kept:
            storage.remove(path)
    for name in storage.listdir(root):
        if name.startswith(".tmp-"):
            storage.remove(root / name)


def step_of(path: Path) -> int:
    m = _STEP_DIR.match(path.name)
    assert m is not None, path
    return int(m.group(1))


def _write_failure(path: Path, error: BaseException) -> str:
    """Which file could not be written and why, in words, instead of torch's internal message."""
    peer = distributed.peer_failure(error)
    if peer is not None:  # not the disk: another rank died (killed during the save, say)
        return (f"could not write {path}: a collective with the other ranks failed during the "
                f"save ({peer}). Another rank most likely died: its own error, or torchrun's "
                f"report of how it ended, says why. The disk is not known to be at fault: the "
                f"checkpoints written before are intact, and resume=auto continues from the "
                f"newest.")
    cause = error
    while not isinstance(cause, OSError) and cause.__context__ is not None:
        cause = cause.__context__  # torch.save's RuntimeError hides the file's OSError
    if not isinstance(cause, OSError):
        return f"could not write {path}: {error}"
    why = os.strerror(cause.errno) if cause.errno else str(cause)
    if cause.errno == errno.ENOSPC:
        why += f" ({_free(path)} free)"
    elif cause.errno == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        why += (f": the file size limit of this process (ulimit -f, RLIMIT_FSIZE) is "
                f"{limit} bytes" if limit != resource.RLIM_INFINITY else "")
    return (f"could not write {path}: {why}. The checkpoints written before are intact and the "
            f"incomplete files were removed. A checkpoint is written in full before older ones "
            f"are deleted, so trainer.keep_last=K needs room for K+1 checkpoints; make room, or "
            f"set trainer.run_dir on a larger disk, then continue with resume=auto.")


def _free(path: Path) -> str:
    for parent in (path, *path.parents):
        if parent.exists():
            return f"{shutil.disk_usage(parent).free / 2**20:.1f} MiB"
    return "unknown"


def write_tensor_file(path: Path, obj: Any, storage: Storage = LOCAL) -> dict[str, Any]:
    """torch.save to `path`, durably; returns its manifest entry (size and SHA-256)."""
    with storage.open_write(path) as f:
        torch.save(obj, f)
    size, sha256 = file_digest(path, storage)
    return {"bytes": size, "sha256": sha256}


def file_digest(path: Path, storage: Storage = LOCAL) -> tuple[int, str]:
    """File `path`'s size in bytes and SHA-256, read back from the storage."""
    digest, size = hashlib.sha256(), 0
    with storage.open_read(path) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
            size += len(block)
    return size, digest.hexdigest()
