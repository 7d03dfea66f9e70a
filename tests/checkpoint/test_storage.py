"""Checkpoint storage is one interface (`saferun.checkpoint.Storage`): a run saved and resumed
through another implementation keeps every checkpoint file there, and no module opens, lists or
renames a checkpoint path except through it."""

import ast
from pathlib import Path

import pytest
import torch

import saferun
from helpers import assert_equal_nested
from saferun.checkpoint import LocalStorage
from toys import ToyTrainer, toy_config

PACKAGE = Path(saferun.__file__).parent


class Elsewhere(LocalStorage):
    """Keeps the checkpoints under `virtual` (a run directory's checkpoints/) in `real`, and
    records each call: code that reached the files without it would find nothing there."""

    def __init__(self, virtual: Path, real: Path) -> None:
        self.virtual, self.real, self.calls = virtual, real, []

    def _at(self, path):
        path = Path(path)
        if path == self.virtual or self.virtual in path.parents:
            return self.real / path.relative_to(self.virtual)
        return path

    def _call(self, name, *paths):
        self.calls.append((name, *map(Path, paths)))
        return getattr(super(), name)(*map(self._at, paths))

    def isdir(self, path):
        return self._call("isdir", path)

    def isfile(self, path):
        return self._call("isfile", path)

    def listdir(self, path):
        return self._call("listdir", path)

    def remove(self, path):
        return self._call("remove", path)

    def makedirs(self, path):
        return self._call("makedirs", path)

    def open_read(self, path):
        return self._call("open_read", path)

    def open_write(self, path):
        return self._call("open_write", path)

    def modified(self, path):
        return self._call("modified", path)

    def publish(self, tmp, final):
        return self._call("publish", tmp, final)


def config(run_dir, **kw):
    cfg = toy_config(run_dir.parent, max_steps=12, save_every_n_steps=4, keep_last=2,
                     log_every_n_steps=2, val_every_n_steps=4, save_best="val/loss", **kw)
    cfg["trainer"]["run_dir"] = str(run_dir)
    return cfg


def whole_state(trainer):
    state = trainer.state_dict()
    del state["config"]["trainer"]["run_dir"], state["config"]["resume"], state["provenance"]
    state["loop"]["best"][1] = Path(state["loop"]["best"][1]).name  # (each run's own directory)
    state["loop"]["metrics"] = {k: v for k, v in state["loop"]["metrics"].items()
                                if not k.startswith("perf/")}  # throughput: wall-clock
    return state


def test_a_run_saved_and_resumed_through_another_storage_is_the_uninterrupted_run(tmp_path):
    straight = ToyTrainer(config(tmp_path / "straight"))
    straight.fit()

    run = tmp_path / "elsewhere"
    store = Elsewhere(run / "checkpoints", tmp_path / "store")
    first = ToyTrainer(config(run), storage=store)
    first.fit()
    assert not (run / "checkpoints").exists()  # every checkpoint file went through the storage
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["step-00000008", "step-00000012"]
    assert ("publish", run / "checkpoints" / ".tmp-step-00000012", run / "checkpoints" / "step-00000012") \
        in [(c[0], c[1].with_name(c[1].name.rsplit("-", 1)[0]), c[2]) for c in store.calls if c[0] == "publish"]

    store.remove(run / "checkpoints" / "step-00000012")  # as if killed before step 12's save
    resumed_store = Elsewhere(run / "checkpoints", tmp_path / "store")
    cfg = config(run)
    cfg["resume"] = "auto"
    resumed = ToyTrainer(cfg, storage=resumed_store)
    resumed.fit()
    assert resumed_store.calls[0][0] == "isfile"  # found through it: resume=auto's newest, step 8
    assert ("open_read", run / "checkpoints" / "step-00000008" / "state.pt") in resumed_store.calls
    assert not (run / "checkpoints").exists()
    assert_equal_nested(whole_state(resumed), whole_state(straight))
    assert_equal_nested(torch.load(run / "model.pt", weights_only=True),
                        torch.load(tmp_path / "straight" / "model.pt", weights_only=True))


# Modules that work with checkpoints reach their files only through a Storage. Allowed: the
# LocalStorage itself; files of the run directory that are not checkpoints (model.pt and its
# record, config.yaml, a .pt file the user names); DCP's own reader of a sharded checkpoint.
CHECKPOINT_MODULES = {
    "checkpoint/store.py": {"LocalStorage", "save_weights", "_free"},
    "checkpoint/checkpointer.py": set(), "checkpoint/formats.py": set(),
    "checkpoint/sharded.py": {"SafeReader"},
    "checkpoint/weights.py": {"saved_config", "publish_weights", "_summary", "load_verified",
                              "check_out_dir", "find_weights"},
    "guards/badstep.py": set(), "guards/replay.py": set(), "preemption.py": set(),
    "trainer.py": set(),
}
FILE_CALLS = {"rename", "rmtree", "unlink", "mkdir", "iterdir", "is_dir", "is_file", "exists",
              "stat", "glob", "rglob", "read_bytes", "write_bytes", "read_text", "write_text",
              "fsync", "listdir", "makedirs", "rmdir", "getsize", "getmtime", "isdir", "isfile",
              "lexists", "touch"}


def file_calls(tree, allowed):
    """(function, line, call) for each file operation outside `allowed` and a storage."""
    found = []

    def visit(node, where):
        for child in ast.iter_child_nodes(node):
            name = where
            if isinstance(child, (ast.FunctionDef, ast.ClassDef)):
                if child.name in allowed:
                    continue
                name = child.name
            if isinstance(child, ast.Call):
                f = child.func
                on = f.value if isinstance(f, ast.Attribute) else None
                through_storage = (isinstance(on, ast.Name) and on.id == "storage") or (
                    isinstance(on, ast.Attribute) and on.attr == "storage")
                if isinstance(f, ast.Name) and f.id == "open":
                    found.append((name, child.lineno, "open"))
                elif isinstance(f, ast.Attribute) and not through_storage and (
                        f.attr in FILE_CALLS or (isinstance(on, ast.Name) and on.id in ("os", "shutil")
                                                 and f.attr in ("replace", "remove"))):
                    found.append((name, child.lineno, f.attr))
            visit(child, name)

    visit(tree, "")
    return found


@pytest.mark.parametrize("module", sorted(CHECKPOINT_MODULES))
def test_no_checkpoint_file_is_reached_but_through_the_storage(module):
    tree = ast.parse((PACKAGE / module).read_text())
    assert file_calls(tree, CHECKPOINT_MODULES[module]) == []


def test_the_file_check_sees_a_file_call():
    tree = ast.parse("def f(p, storage):\n    storage.isdir(p)\n    p.is_dir()\n    open(p)\n")
    assert [c[2] for c in file_calls(tree, set())] == ["is_dir", "open"]
