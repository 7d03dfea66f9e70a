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

One detector can also watch several series updated together (`series=("loss",
"grad_norm")`: the spike guard's): each update takes one value per series, and
each comparison and refresh is one set of operators over all of them (the
series are a trailing dimension of every tensor), with, per series, the flags
and state of a detector of its own. Its `state_dict` holds one such detector's
state per series, so either loads the other's.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch

_MAD_TO_STD = 1.4826
_MIN_SCALE = 1e-8  # keeps a zero median with a zero MAD from flagging any positive value
_INF, _NAN = float("inf"), float("nan")


class SpikeDetector:
    """Flags values far above the median of the recent ones (see the module docstring).

    Args:
        window: how many recent accepted values the statistics use.
        threshold: how many robust standard deviations above the median is a spike.
        warmup: accepted values needed before anything is flagged (at most `window`).
        min_rel_mad: floor on the MAD, relative to |median|.
        refresh_every: updates between two refreshes of the statistics (the first one
            after `warmup` updates, when the limit can first be finite).
        series: names of several series updated together (values shaped (S,), flags too,
            `update_many` (n, S)); empty (the default): one series, 0-dim values.
    """

    def __init__(self, window: int = 100, threshold: float = 6.0, warmup: int = 20,
                 min_rel_mad: float = 0.01, refresh_every: int = 1,
                 series: Sequence[str] = ()) -> None:
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
        if len(set(series)) != len(series):
            raise ValueError(f"spike detector: the series names must differ; got {tuple(series)}.")
        self.window = window
        self.threshold = threshold
        self.warmup = warmup
        self.min_rel_mad = min_rel_mad
        self.refresh_every = refresh_every
        self.series = tuple(series)
        self._shape = (len(self.series),) if self.series else ()  # one value's, per update
        # The state, series last: (window + 1, *_shape) float32, the window, then a scratch
        # row that the values not kept are written to (so that no index repeats)
        self._ring: Optional[torch.Tensor] = None
        self._values: Optional[torch.Tensor] = None  # the window: _ring[:window]; NaN: empty
        self._count: Optional[torch.Tensor] = None  # int64 _shape: values accepted so far
        self._limit: Optional[torch.Tensor] = None  # float32 _shape; +inf until warmed up
        self._pending: list[torch.Tensor] = []  # values compared with _limit, not yet in the window
        # (NaN for a non-finite one; _shape from `update`, (n, *_shape) from `update_many`)
        self._updates = 0  # updates so far (host side: no sync to decide when to refresh)
        self._due = warmup  # updates until the next refresh
        self.last_limit: Optional[torch.Tensor] = None
        """The limit the last value was compared with (on the device; shaped as a value)."""

    def update(self, value: torch.Tensor) -> torch.Tensor:
        """Return whether `value` is a spike (bool, on its device, shaped as `value`: 0-dim, or
        one per series); keep it if it is not."""
        if self._due == 0:
            self.refresh()
        limit = self._limit
        if limit is None or limit.device != value.device:
            limit = self._state(value.device)[2]
        # (attribute reads only, no call: the loop's values are float32, out of autograd)
        v = self._checked(value, many=False) if value.shape != self._shape or \
            value.dtype is not torch.float32 or value.requires_grad else value
        # NaN and +-Inf become NaN, which no comparison holds for: not a spike, not kept
        v = torch.nan_to_num(v, nan=_NAN, posinf=_NAN, neginf=_NAN)
        self._pending.append(v)
        self._updates += 1
        self._due -= 1
        self.last_limit = limit
        return v > limit

    def update_many(self, values: torch.Tensor) -> torch.Tensor:
        """`update` for each of `values` in order (1-D; with several series, (n, S)), the flags
        stacked: the same flags and state as one `update` per value, with two operators per
        refresh instead of two per value. The loop's catch-up at a log point, when no policy
        acts on a spike at its own step (the raise and rollback policies)."""
        if values.shape[1:] != self._shape or values.dim() != len(self._shape) + 1 or \
                values.dtype is not torch.float32 or values.requires_grad:
            values = self._checked(values, many=True)
        values = torch.nan_to_num(values, nan=_NAN, posinf=_NAN, neginf=_NAN)
        flags, n, i = [], values.shape[0], 0
        while i < n:
            if self._due == 0:
                self.refresh()
            limit = self._limit
            if limit is None or limit.device != values.device:
                limit = self._state(values.device)[2]
            take = min(self._due, n - i)  # the values `update` compares with this limit
            v = values[i:i + take]
            self._pending.append(v)
            flags.append(v > limit)
            self._updates += take
            self._due -= take
            self.last_limit = limit
            i += take
        if not flags:
            return torch.zeros(values.shape, dtype=torch.bool, device=values.device)
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
        k = ((count.clamp(1, self.window) - 1) // 2).unsqueeze(0)
        median = _kth(values, k)  # (1, *_shape)
        mad = _kth((values - median).abs(), k)  # empty slots stay NaN and sort last
        scale = torch.maximum(mad, self.min_rel_mad * median.abs()).clamp(min=_MIN_SCALE)
        limit = torch.add(median, scale, alpha=self.threshold * _MAD_TO_STD).squeeze(0)
        self._limit = limit.masked_fill_(count < self.warmup, _INF)  # +Inf until warmed up

    def _fold(self, ring: torch.Tensor, count: torch.Tensor, limit: torch.Tensor) -> None:
        """Write the pending values that were not spikes into the window's oldest slots, in order
        (`ring`: the window and its scratch row), each series into its own column."""
        pending, self._pending = self._pending, []
        # one value per `update`, several per `update_many`
        one = len(self._shape)  # a value's dimensions
        if all(p.dim() == one for p in pending):
            v = torch.stack(pending)
        else:
            v = pending[0] if len(pending) == 1 else \
                torch.cat([p.unsqueeze(0) if p.dim() == one else p for p in pending])
        accept = v <= limit  # not a spike, and finite (NaN: not finite)
        rank = accept.cumsum(0)  # 1, 2, ... among the accepted
        total = rank[-1]
        # The last `window` accepted go to slots (count + rank - 1) % window (a ring, oldest
        # out); the others to a scratch row past the end: no index repeats, nothing syncs.
        slot = torch.where(accept & (rank > total - self.window),
                           (rank + (count - 1)) % self.window, self.window)
        ring.scatter_(0, slot, v)
        count.add_(total)

    def state_dict(self) -> dict[str, Any]:
        """The window (kept values included), the count of accepted values, the limit in use and
        the updates until the next refresh, as tensors (loads with weights_only); with several
        series, that of each, by name."""
        _, count, limit = self._state(None)
        assert self._ring is not None
        ring, count = self._ring.clone(), count.clone()
        if self._pending:
            pending = list(self._pending)
            self._fold(ring, count, limit)  # into the copies: this detector goes on unchanged
            self._pending = pending
        values = ring[:self.window]
        if not self.series:
            return self._one(values, count, limit)
        return {name: self._one(values[:, i], count[i], limit[i])
                for i, name in enumerate(self.series)}

    def _one(self, values: torch.Tensor, count: torch.Tensor, limit: torch.Tensor) -> dict[str, Any]:
        """One series' state, in tensors of their own (a view would save the whole ring)."""
        return {"values": values.clone(memory_format=torch.contiguous_format),
                "count": count.clone(), "limit": limit.clone(),
                "updates": torch.tensor(self._updates), "due": torch.tensor(self._due)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict` returned (with several series, each series' state by name,
        as a detector of its own, of the same `window`, returned it)."""
        missing = [name for name in self.series if name not in state]
        if missing:
            raise ValueError(f"spike detector: the saved state holds no series {missing} (it "
                             f"holds {sorted(state)}); this detector watches {list(self.series)}.")
        states = [state[name] for name in self.series] if self.series else [state]
        for one in states:
            if tuple(one["values"].shape) != (self.window,):
                raise ValueError(f"spike detector: the saved state holds a window of "
                                 f"{tuple(one['values'].shape)} values, but this detector has "
                                 f"window={self.window}. Resume with the same window.")
        kept = all("limit" in one for one in states)
        if kept and len({(int(one["updates"]), int(one["due"])) for one in states}) > 1:
            raise ValueError(f"spike detector: the saved series {list(self.series)} were not "
                             f"updated together (their update counts differ), so they cannot "
                             f"be watched as one; load each into a detector of its own.")

        def joined(key: str) -> torch.Tensor:  # the series side by side, in the last dimension
            got = [one[key].detach() for one in states]
            return torch.stack(got, -1) if self.series else got[0]

        values = joined("values").to(torch.float32)
        self._ring = torch.cat([values, torch.full((1, *self._shape), _NAN, device=values.device)])
        self._values = self._ring[:self.window]
        self._count = joined("count").to(device=values.device, dtype=torch.int64).clone()
        self._pending = []
        if kept:
            self._limit = joined("limit").to(values).clone()
            self._updates, self._due = int(states[0]["updates"]), int(states[0]["due"])
        else:  # saved before the limit was kept (every update recomputed it): recompute it now
            self._limit = torch.full(self._shape, _INF, device=values.device)
            # (several series: the smallest count, so that a window still filling refreshes
            # at each update, as its own detector would)
            self._updates = min(int(one["count"]) for one in states)
            self.refresh()

    def _checked(self, value: torch.Tensor, many: bool) -> torch.Tensor:
        """`value` as float32 out of autograd, shaped as one update's values (`many`: as several
        updates', in the first dimension); refused unless it holds them."""
        if many:  # (one series: any number of values)
            good = not self.series or (value.dim() == 2 and value.shape[1] == len(self.series))
        else:
            good = value.numel() == (len(self.series) or 1)
        if not good:
            what = f"one value per series {list(self.series)}" if self.series else "a scalar"
            raise ValueError(f"spike detector: expected {what}{' per update' if many else ''}, "
                             f"got shape {tuple(value.shape)}.")
        return value.detach().reshape((-1, *self._shape) if many else self._shape).to(torch.float32)

    def _state(self, device: Optional[torch.device]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The window, count and limit, created on first use and moved to `device` if it differs."""
        if self._ring is None:
            self._ring = torch.full((self.window + 1, *self._shape), _NAN, device=device)
            self._values = self._ring[:self.window]
            self._count = torch.zeros(self._shape, dtype=torch.int64, device=device)
            self._limit = torch.full(self._shape, _INF, device=device)
        assert self._values is not None and self._count is not None and self._limit is not None
        if device is not None and self._ring.device != device:
            self._ring = self._ring.to(device)
            self._values = self._ring[:self.window]
            self._count = self._count.to(device)
            self._limit = self._limit.to(device)
        return self._values, self._count, self._limit


def _kth(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The entries at place `k` ((1, *series), on the device) of `x` sorted along its first
    dimension, NaN last; shaped as `k`.

    torch.nanmedian would do, but on CUDA it indexes with a tensor, which reads
    it back to the host (aten/src/ATen/native/cuda/Sorting.cpp, median_impl).
    """
    return torch.sort(x, dim=0).values.gather(0, k)
