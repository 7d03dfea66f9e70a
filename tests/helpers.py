"""Helpers that several test files share (tests/ is on sys.path: see conftest.py)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Optional

import torch


@contextlib.contextmanager
def cpu_grad_scaler(**options: float) -> Iterator[None]:
    """A Trainer set up inside gets a real, enabled GradScaler on the CPU (fp16 autocast needs
    CUDA; the scaler's part of the step is the same): loss scaling, unscale_ before the clip,
    its skips and its checkpoint state, tested without a GPU. The Trainer hands its scaler to
    the parts that use it at setup, so the scaler is chosen there, not replaced after."""
    import saferun.trainer as trainer_module

    real = trainer_module.grad_scaler
    trainer_module.grad_scaler = lambda device, precision: torch.amp.GradScaler("cpu", **options)
    try:
        yield
    finally:
        trainer_module.grad_scaler = real


def free_port() -> int:
    """A TCP port free on the loopback interface now (torchrun's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def superseded(run_dir: Path) -> list[Path]:
    """The folders that resume=fresh (or a changed course) moved an earlier run's files into."""
    return [p for p in run_dir.iterdir() if p.name.startswith("superseded-")]


def pytest_in(path: Path, *args: str, timeout: float = 300,
              env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess:
    """`cd path && pytest -q ARGS` in a subprocess, as a user runs it, with `env` added."""
    base = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}  # PYTHONPATH kept:
    # tools/mutate.py puts its mutated copy of saferun first on it
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          cwd=path, capture_output=True, text=True, timeout=timeout,
                          env={**base, **(env or {})})


class InfGrad(torch.autograd.Function):
    """Identity forward; an infinite gradient backward: an fp16 overflow, with a finite loss,
    that the GradScaler must skip."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


def assert_equal_nested(got, want, where: str = "state") -> None:
    """Nested dicts, lists and tensors equal: tensors bitwise, the rest exactly."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for k in want:
            assert_equal_nested(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_equal_nested(g, w, f"{where}[{i}]")
    else:
        assert got == want, where

