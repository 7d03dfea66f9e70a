"""Loss spikes and gradient explosions, detected on the device without a host sync.

`SpikeDetector.update(value)` compares a scalar (the loss, the gradient norm)
with a limit computed from robust statistics of the last `window` accepted
values: the median and the median absolute deviation (MAD). The value is a
spike when

    value > median + threshold * 1.4826 * max(MAD, min_rel_mad * |median|)

(1.4826 * MAD estimates the standard deviation of normal data; the floor keeps
a flat history from turning noise into spikes). Spikes are not added to the
window, so they do not drag the statistics up, and neither are NaN and Inf,
which are not spikes: the non-finite guard handles them. As a consequence a
lasting jump in level is flagged at every step until something else acts.

What cannot wait runs at every update: the comparison with the limit, held on
the device (two small ops; on CUDA, two kernel launches that do not wait for
the GPU), and the value is kept for the window. What can wait is done every
`refresh_every` updates: the kept values join the window (those that were not
spikes, oldest out first) and the limit is recomputed (about 30 small ops). So
every value is checked at its own update, against statistics at most
`refresh_every` updates old; with `refresh_every=1` the statistics are those
of all the values before it. The result is a 0-dim bool tensor for the loop to
act on or to read at a log step.

`update_many(values)` does the same for several values in order, in one
comparison per refresh: a policy that acts at log points (raise, rollback)
compares a log interval's steps there, with the flags and state that one
`update` per step would give.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

_MAD_TO_STD = 1.4826
_MIN_SCALE = 1e-8  # keeps a zero median with a zero MAD from flagging any positive value
_INF, _NEG_INF = float("inf"), float("-inf")


class SpikeDetector:
    """Flags values far above the median of the recent ones (see the module docstring).

    Args:
        window: how many recent accepted values the statistics use.
        threshold: how many robust standard deviations above the median is a spike.
        warmup: accepted values needed before anything is flagged (at most `window`).
        min_rel_mad: floor on the MAD, relative to |median|.
        refresh_every: updates between two refreshes of the statistics (the first one
            after `warmup` updates, when the limit can first be finite).
    """

    def __init__(self, window: int = 100, threshold: float = 6.0, warmup: int = 20,
                 min_rel_mad: float = 0.01, refresh_every: int = 1) -> None:
        if window < 1:
            raise ValueError(f"spike detector: window must be at least 1; got {window}.")
        if not 1 <= warmup <= window:
            raise ValueError(f"spike detector: warmup must be between 1 and window={window}; "
                             f"got {warmup}.")
        if threshold <= 0 or min_rel_mad < 0:
            raise ValueError(f"spike detector: threshold must be positive and min_rel_mad not "
                             f"negative; got {threshold} and {min_rel_mad}.")
        if refresh_every < 1:
            raise ValueError(f"spike detector: refresh_every must be at least 1; got {refresh_every}.")
        self.window = window
        self.threshold = threshold
        self.warmup = warmup
        self.min_rel_mad = min_rel_mad
        self.refresh_every = refresh_every
        self._ring: Optional[torch.Tensor] = None  # (window + 1,) float32: the window, then a
        # scratch slot that the values not kept are written to (so that no index repeats)
        self._values: Optional[torch.Tensor] = None  # the window: _ring[:window]; NaN: empty
        self._count: Optional[torch.Tensor] = None  # int64 0-dim: values accepted so far
        self._limit: Optional[torch.Tensor] = None  # float32 0-dim; +inf until warmed up
        self._pending: list[torch.Tensor] = []  # values compared with _limit, not yet in the window
        # (with NaN and +Inf as -Inf; 0-dim from `update`, 1-D from `update_many`)
        self._updates = 0  # values seen (host side: no sync to decide when to refresh)
        self._due = warmup  # updates until the next refresh
        self.last_limit: Optional[torch.Tensor] = None
        """The limit the last value was compared with (0-dim, on the device)."""

    def update(self, value: torch.Tensor) -> torch.Tensor:
        """Return whether `value` is a spike (0-dim bool, on its device); keep it if it is not."""
        if self._due == 0:
            self.refresh()
        limit = self._limit
        if limit is None or limit.device != value.device:
            limit = self._state(value.device)[2]
        # (attribute reads only, no call: the loop's loss and gradient norm are float32 scalars)
        v = _scalar(value) if value.shape or value.dtype is not torch.float32 or \
            value.requires_grad else value
        # NaN and +Inf become -Inf, which is never above the limit: non-finite is not a spike.
        v = torch.nan_to_num(v, nan=_NEG_INF, posinf=_NEG_INF, neginf=_NEG_INF)
        self._pending.append(v)
        self._updates += 1
        self._due -= 1
        self.last_limit = limit
        return v > limit

    def update_many(self, values: torch.Tensor) -> torch.Tensor:
        """`update` for each of `values` in order (1-D; 0-dim bool flags, stacked): the same
        flags and state as one `update` per value, with three operators per refresh instead
        of two per value. The loop's catch-up at a log point, when no policy acts on a spike
        at its own step (the raise and rollback policies)."""
        values = values.detach().reshape(-1).to(torch.float32)
        flags, n, i = [], values.numel(), 0
        while i < n:
            if self._due == 0:
                self.refresh()
            limit = self._limit
            if limit is None or limit.device != values.device:
                limit = self._state(values.device)[2]
            take = min(self._due, n - i)  # the values `update` compares with this limit
            v = torch.nan_to_num(values[i:i + take], nan=_NEG_INF, posinf=_NEG_INF,
                                 neginf=_NEG_INF)
            self._pending.append(v)
            flags.append(v > limit)
            self._updates += take
            self._due -= take
            self.last_limit = limit
            i += take
        if not flags:
            return torch.zeros(0, dtype=torch.bool, device=values.device)
        return flags[0] if len(flags) == 1 else torch.cat(flags)

    def refresh(self) -> None:
        """Add the kept values to the window, recompute the limit on the device (no sync)."""
        # While the window fills, each value moves the statistics much: refresh at every update.
        self._due = 1 if self._updates < self.window else self.refresh_every
        if self._values is None and not self._pending:
            return
        device = self._pending[0].device if self._pending else None
        values, count, limit = self._state(device)
        if self._pending:
            assert self._ring is not None
            self._fold(self._ring, count, limit)
        # the lower median's place among the min(count, window) values kept (0 when none)
        k = ((count.clamp(1, self.window) - 1) // 2).reshape(1)
        median = _kth(values, k)
        mad = _kth((values - median).abs(), k)  # empty slots stay NaN and sort last
        scale = torch.maximum(mad, self.min_rel_mad * median.abs()).clamp(min=_MIN_SCALE)
        limit = torch.add(median, scale, alpha=self.threshold * _MAD_TO_STD)
        self._limit = limit.masked_fill_(count < self.warmup, _INF)  # +Inf until warmed up

    def _fold(self, ring: torch.Tensor, count: torch.Tensor, limit: torch.Tensor) -> None:
        """Write the pending values that were not spikes into the window's oldest slots, in order
        (`ring`: the window and its scratch slot)."""
        pending, self._pending = self._pending, []
        # one value per `update`, several per `update_many`
        v = torch.stack(pending) if all(p.dim() == 0 for p in pending) else \
            torch.cat([p.reshape(-1) for p in pending])
        accept = (v <= limit) & (v > _NEG_INF)  # not a spike, and finite (-Inf: not finite)
        rank = accept.cumsum(0)  # 1, 2, ... among the accepted
        total = rank[-1]
        # The last `window` accepted go to slots (count + rank - 1) % window (a ring, oldest
        # out); the others to a scratch slot past the end: no index repeats, nothing syncs.
        slot = torch.where(accept & (rank > total - self.window),
                           (rank + (count - 1)) % self.window, self.window)
        ring.scatter_(0, slot, v)
        count.add_(total)

    def state_dict(self) -> dict[str, Any]:
        """The window (kept values included), the count of accepted values, the limit in use and
        the updates until the next refresh, as tensors (loads with weights_only)."""
        _, count, limit = self._state(None)
        assert self._ring is not None
        ring, count = self._ring.clone(), count.clone()
        if self._pending:
            pending = list(self._pending)
            self._fold(ring, count, limit)  # into the copies: this detector goes on unchanged
            self._pending = pending
        return {"values": ring[:self.window].clone(), "count": count, "limit": limit.clone(),
                "updates": torch.tensor(self._updates), "due": torch.tensor(self._due)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict` returned; the window size must match."""
        values, count = state["values"], state["count"]
        if tuple(values.shape) != (self.window,):
            raise ValueError(f"spike detector: the saved state holds a window of "
                             f"{tuple(values.shape)} values, but this detector has "
                             f"window={self.window}. Resume with the same window.")
        self._ring = torch.cat([values.detach().to(torch.float32),
                                torch.full((1,), float("nan"), device=values.device)])
        self._values = self._ring[:self.window]
        self._count = count.detach().to(device=self._values.device, dtype=torch.int64).clone()
        self._pending = []
        if "limit" in state:
            self._limit = state["limit"].detach().to(self._values).clone()
            self._updates, self._due = int(state["updates"]), int(state["due"])
        else:  # saved before the limit was kept (every update recomputed it): recompute it now
            self._limit = torch.full((), _INF, device=self._values.device)
            self._updates = int(self._count)
            self.refresh()

    def _state(self, device: Optional[torch.device]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The window, count and limit, created on first use and moved to `device` if it differs."""
        if self._ring is None:
            self._ring = torch.full((self.window + 1,), float("nan"), device=device)
            self._values = self._ring[:self.window]
            self._count = torch.zeros((), dtype=torch.int64, device=device)
            self._limit = torch.full((), float("inf"), device=device)
        assert self._values is not None and self._count is not None and self._limit is not None
        if device is not None and self._ring.device != device:
            self._ring = self._ring.to(device)
            self._values = self._ring[:self.window]
            self._count = self._count.to(device)
            self._limit = self._limit.to(device)
        return self._values, self._count, self._limit


def _scalar(value: torch.Tensor) -> torch.Tensor:
    """`value` as a float32 0-dim tensor out of autograd; refused unless it holds one number."""
    if value.numel() != 1:
        raise ValueError(f"spike detector: expected a scalar, got shape {tuple(value.shape)}.")
    return value.detach().reshape(()).to(torch.float32)


def _kth(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The entry at place `k` (a 1-element device tensor) of `x` sorted, NaN last, on the device.

    torch.nanmedian would do, but on CUDA it indexes with a tensor, which reads
    it back to the host (aten/src/ATen/native/cuda/Sorting.cpp, median_impl).
    """
    return torch.sort(x).values.gather(0, k).reshape(())
