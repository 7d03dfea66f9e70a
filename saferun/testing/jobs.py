"""What the testing helpers run: a Trainer class, its constructor arguments and a config."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch

from ..callbacks import Callback
from ..config import Config, load_config
from ..trainer import Trainer


@dataclass(frozen=True)
class Job:
    """A Trainer subclass, the keyword arguments of its constructor, and the config to test.

    Build one with `recipe(...)` or `trainer(...)`. Each helper runs fresh Trainers of
    this class, made from a copy of `config` with its own short-run settings (steps,
    a temporary run directory, no logger); the class must accept `callbacks=` as the
    Trainer does.
    """

    cls: type[Trainer]
    config: Config
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.config.name if self.config.name != "run" else self.cls.__name__

    def build(self, cfg: Config, callbacks: Sequence[Callback] = ()) -> Trainer:
        """A fresh Trainer of this job for `cfg`."""
        return self.cls(cfg, callbacks=list(callbacks), **self.kwargs)

    def factory(self) -> Any:
        """`cfg -> Trainer`, as `saferun.check.run_checks` takes it."""
        return lambda cfg: self.build(cfg)

    def short(self, run_dir: str | os.PathLike[str], resume: Optional[str] = None,
              **trainer: Any) -> Config:
        """A copy of the config for a short test run in `run_dir`: no logger, no progress bar,
        no periodic checkpoints, plus the given `trainer.` settings."""
        cfg = copy.deepcopy(self.config)
        t = dataclasses.replace(cfg.trainer, run_dir=str(run_dir), progress_bar=False,
                                save_every_n_steps=None, **trainer)
        return dataclasses.replace(cfg, trainer=t, logger={}, resume=resume)


def trainer(cls: type[Trainer], cfg: Any = None, **kwargs: Any) -> Job:
    """A job for the Trainer subclass `cls` with config `cfg` (a dict, an OmegaConf node or
    a `saferun.Config`); `kwargs` go to its constructor."""
    if not (isinstance(cls, type) and issubclass(cls, Trainer)):
        raise TypeError(f"saferun.testing.trainer takes a Trainer subclass, not {cls!r}.")
    return Job(cls, load_config(cfg), dict(kwargs))


def recipe(name: str, *overrides: str, config_dir: str | os.PathLike[str] | None = None) -> Job:
    """The job `saferun run recipe=NAME OVERRIDES` would train (with `-cd config_dir`).

    `config_dir` is your project's directory (the one `saferun new` wrote), so that
    `recipe=NAME` finds NAME.yaml there and its `_target_`s import from it.
    """
    from hydra.utils import get_class

    from ..cli.compose import compose_config

    dirs = [str(config_dir)] if config_dir is not None else []
    config = compose_config([f"recipe={name}", *overrides], dirs)
    task = dict(config.task or {"_target_": "saferun.Trainer"})
    return Job(get_class(task.pop("_target_")), config, task)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one CPU thread for the block: numerics that do not depend on the machine's
    core count, and tiny runs that do not contend with each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def work_dir(tmp_dir: str | os.PathLike[str] | None, prefix: str) -> Iterator[Path]:
    """`tmp_dir` if given (kept, for a look after a failure), else a fresh temporary directory."""
    if tmp_dir is not None:
        Path(tmp_dir).mkdir(parents=True, exist_ok=True)
        yield Path(tmp_dir)
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield Path(tmp)


def probe(job: Job, cfg: Config) -> tuple[Optional[int], bool]:
    """(optimizer steps in one epoch of `cfg`'s training data, or None without a length;
    whether there is a validation set)."""
    t = job.build(cfg)
    t.setup()
    loader = t.train_loader
    assert loader is not None
    validates = t.val_loader is not None
    try:
        batches = len(loader)
    except TypeError:
        return None, validates
    return math.ceil(batches / cfg.trainer.accumulate), validates


def fail(message: str) -> None:
    """Fail the test with `message` and no traceback into saferun (pytest's `fail`)."""
    try:
        import pytest
    except ImportError:  # pragma: no cover - the helpers work without pytest too
        raise AssertionError(message) from None
    pytest.fail(message, pytrace=False)
