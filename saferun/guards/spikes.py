"""Loss spikes and gradient explosions, detected on the device without a host sync.

`SpikeDetector.update(value)` compares a scalar (the loss, the gradient norm)
with robust statistics of the last `window` accepted values: the median and
the median absolute deviation (MAD). The value is a spike when

    value > median + threshold * 1.4826 * max(MAD, min_rel_mad * |median|)

(1.4826 * MAD estimates the standard deviation of normal data; the floor keeps
a flat history from turning noise into spikes). Spikes are not added to the
window, so they do not drag the statistics up, and neither are NaN and Inf,
which are not spikes: the non-finite guard handles them. As a consequence a
lasting jump in level is flagged at every step until something else acts.

Each update is about 25 small ops on the value's device (about 0.3 ms on one
CPU thread; on CUDA, kernel launches that do not wait for the GPU). The result
is a 0-dim bool tensor for the loop to act on or to read at a log step.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

_MAD_TO_STD = 1.4826
_MIN_SCALE = 1e-8  # keeps a zero median with a zero MAD from flagging any positive value


class SpikeDetector:
    """Flags values far above the median of the recent ones (see the module docstring).

    Args:
        window: how many recent accepted values the statistics use.
        threshold: how many robust standard deviations above the median is a spike.
        warmup: accepted values needed before anything is flagged (at most `window`).
        min_rel_mad: floor on the MAD, relative to |median|.
    """

    def __init__(self, window: int = 100, threshold: float = 6.0, warmup: int = 20,
                 min_rel_mad: float = 0.01) -> None:
        if window < 1:
            raise ValueError(f"spike detector: window must be at least 1; got {window}.")
        if not 1 <= warmup <= window:
            raise ValueError(f"spike detector: warmup must be between 1 and window={window}; "
                             f"got {warmup}.")
        if threshold <= 0 or min_rel_mad < 0:
            raise ValueError(f"spike detector: threshold must be positive and min_rel_mad not "
                             f"negative; got {threshold} and {min_rel_mad}.")
        self.window = window
        self.threshold = threshold
        self.warmup = warmup
        self.min_rel_mad = min_rel_mad
        self._values: Optional[torch.Tensor] = None  # (window,) float32; NaN marks an empty slot
        self._count: Optional[torch.Tensor] = None  # int64 0-dim: values accepted so far
        self._slots: Optional[torch.Tensor] = None  # arange(window)
        self.last_limit: Optional[torch.Tensor] = None
        """The limit the last value was compared with (0-dim, on the device)."""

    def update(self, value: torch.Tensor) -> torch.Tensor:
        """Return whether `value` is a spike (0-dim bool, on its device); add it if it is not."""
        if value.numel() != 1:
            raise ValueError(f"spike detector: expected a scalar, got shape {tuple(value.shape)}.")
        values, count, slots = self._state(value.device)
        v = value.detach().reshape(()).to(torch.float32)
        n = count.clamp(max=self.window)
        median = _lower_median(values, n)
        mad = _lower_median((values - median).abs(), n)
        scale = torch.maximum(mad, self.min_rel_mad * median.abs()).clamp(min=_MIN_SCALE)
        limit = median + self.threshold * _MAD_TO_STD * scale
        finite = torch.isfinite(v)
        spike = finite & (count >= self.warmup) & (v > limit)
        accept = finite & ~spike
        # Write into the oldest slot with a mask: indexing with a device tensor would sync.
        values.copy_(torch.where((slots == count % self.window) & accept, v, values))
        count.add_(accept.to(torch.int64))
        self.last_limit = limit
        return spike

    def state_dict(self) -> dict[str, Any]:
        """The window and the count of accepted values, as tensors (loads with weights_only)."""
        values, count, _ = self._state(None)
        return {"values": values.clone(), "count": count.clone()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict` returned; the window size must match."""
        values, count = state["values"], state["count"]
        if tuple(values.shape) != (self.window,):
            raise ValueError(f"spike detector: the saved state holds a window of "
                             f"{tuple(values.shape)} values, but this detector has "
                             f"window={self.window}. Resume with the same window.")
        self._values = values.detach().to(torch.float32).clone()
        self._count = count.detach().to(device=self._values.device, dtype=torch.int64).clone()
        self._slots = torch.arange(self.window, device=self._values.device)

    def _state(self, device: Optional[torch.device]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The buffers, created on first use and moved to `device` if it differs."""
        if self._values is None:
            self._values = torch.full((self.window,), float("nan"), device=device)
            self._count = torch.zeros((), dtype=torch.int64, device=device)
            self._slots = torch.arange(self.window, device=device)
        assert self._count is not None and self._slots is not None
        if device is not None and self._values.device != device:
            self._values = self._values.to(device)
            self._count = self._count.to(device)
            self._slots = self._slots.to(device)
        return self._values, self._count, self._slots


def _lower_median(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """The lower median of the `n` finite entries of `x` (the rest are NaN), on the device.

    torch.nanmedian would do, but on CUDA it indexes with a tensor, which reads
    it back to the host (aten/src/ATen/native/cuda/Sorting.cpp, median_impl).
    """
    ordered = torch.sort(x).values  # NaN sorts last
    k = ((n - 1).clamp(min=0) // 2).reshape(1)
    return ordered.gather(0, k).reshape(())
