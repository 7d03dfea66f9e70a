"""Helpers that several test files share (tests/ is on sys.path: see conftest.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Optional

import torch


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
