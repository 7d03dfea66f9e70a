"""Autocast and gradient scaling for the configured precision."""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, ContextManager

import torch

from ..errors import ConfigError


def autocast_factory(device: torch.device, precision: str) -> Callable[[], ContextManager]:
    """A zero-argument factory for the forward pass's autocast context."""
    if precision == "fp32":
        return contextlib.nullcontext
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError(
            "trainer.precision=fp16 needs a CUDA device (fp16 autocast with a GradScaler); "
            f"the device is {device}. Use trainer.precision=bf16 on CPU."
        )
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return functools.partial(torch.autocast, device_type=device.type, dtype=dtype)


def grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler:
    """An active GradScaler for fp16, a disabled one (plain pass-through) otherwise.

    A disabled scaler keeps one code path in the step: `scale` returns the
    loss, `unscale_` and `update` do nothing, `step` calls `optimizer.step()`.
    """
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")
