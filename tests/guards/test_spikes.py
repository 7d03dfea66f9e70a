"""Guard 3: loss spikes and gradient explosions are flagged on the device, before the update."""

import io

import pytest
import torch

from saferun.guards.spikes import SpikeDetector
from saferun.guards.syncs import HostSyncCounter


def noisy(n: int, level: float = 2.0, noise: float = 0.05, seed: int = 0) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return (level + noise * torch.randn(n, generator=g)).tolist()


def flags(detector: SpikeDetector, values: list[float]) -> list[bool]:
    out = [detector.update(torch.tensor(v)) for v in values]
    return torch.stack(out).tolist()  # one read, after the fact, as the loop would at a log step


def test_a_loss_spike_is_flagged_and_its_neighbours_are_not():
    values = noisy(60)
    values[40] = 20.0
    found = flags(SpikeDetector(window=30, warmup=10), values)
    assert [i for i, f in enumerate(found) if f] == [40]


def test_a_gradient_explosion_is_flagged_after_slow_growth_is_accepted():
    growth = [1.0 + 0.01 * i + v for i, v in enumerate(noisy(100, level=0.0, noise=0.02))]
    values = growth + [10 * growth[-1]]
    found = flags(SpikeDetector(window=50, warmup=10), values)
    assert [i for i, f in enumerate(found) if f] == [100]


def test_spikes_do_not_enter_the_window_so_a_second_one_is_flagged_too():
    d = SpikeDetector(window=20, warmup=10)
    flags(d, noisy(20))
    before = d.state_dict()
    assert flags(d, [50.0, 50.0, 50.0]) == [True, True, True]
    after = d.state_dict()
    assert torch.equal(after["count"], before["count"])
    assert torch.equal(after["values"], before["values"])
    assert flags(d, [2.0]) == [False] and int(d.state_dict()["count"]) == 21


def test_nothing_is_flagged_during_warmup_and_warmup_values_are_kept():
    d = SpikeDetector(window=10, warmup=5)
    assert flags(d, [1.0, 1.0, 100.0, 1.0, 1.0]) == [False] * 5
    assert 100.0 in d.state_dict()["values"].tolist()


def test_non_finite_values_are_neither_spikes_nor_kept():
    d = SpikeDetector(window=10, warmup=3)
    flags(d, [1.0, 1.1, 0.9])
    assert flags(d, [float("nan"), float("inf"), float("-inf")]) == [False] * 3
    assert int(d.state_dict()["count"]) == 3


def test_the_mad_floor_keeps_a_flat_history_from_flagging_noise():
    d = SpikeDetector(window=10, warmup=5, threshold=6.0, min_rel_mad=0.01)
    flags(d, [1.0] * 10)  # MAD is 0; the floor is 1% of the median
    assert flags(d, [1.05, 1.2]) == [False, True]  # limit: 1 + 6 * 1.4826 * 0.01 = 1.089


def test_the_window_forgets_old_values():
    d = SpikeDetector(window=10, warmup=10)
    flags(d, [1.0] * 10 + [1.08] * 10)  # each step within the floor; ten of them replace the 1.0s
    assert d.state_dict()["values"].tolist() == pytest.approx([1.08] * 10)
    assert flags(d, [1.17]) == [False]  # would be a spike against the old level


def test_update_returns_a_device_bool_and_never_syncs():
    d = SpikeDetector(window=16, warmup=4)
    losses = [torch.tensor(v) for v in noisy(50) + [30.0]]
    with HostSyncCounter() as counter:
        out = [d.update(loss) for loss in losses]
    assert counter.count == 0, counter.sites
    assert out[-1].dtype == torch.bool and out[-1].shape == () and bool(out[-1])
    assert d.last_limit is not None and d.last_limit.shape == ()


def test_state_round_trips_through_a_weights_only_checkpoint_with_identical_decisions():
    history, future = noisy(70, seed=1), noisy(40, seed=2)
    future[5], future[25] = 3.0, 9.0  # spikes only against the history
    uninterrupted = SpikeDetector(window=32, warmup=16)
    flags(uninterrupted, history)
    buffer = io.BytesIO()
    torch.save(uninterrupted.state_dict(), buffer)
    buffer.seek(0)
    resumed = SpikeDetector(window=32, warmup=16)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    expected = flags(uninterrupted, future)
    assert flags(resumed, future) == expected
    assert expected[5] and expected[25]
    assert not any(flags(SpikeDetector(window=32, warmup=16), future)[:16])  # a fresh one differs
    assert torch.equal(resumed.state_dict()["values"], uninterrupted.state_dict()["values"])


def test_state_dict_is_a_copy_and_a_wrong_window_is_refused():
    d = SpikeDetector(window=8, warmup=2)
    flags(d, [1.0, 2.0])
    state = d.state_dict()
    assert flags(d, [1.0]) == [False]  # accepted: the detector's count moves on
    assert int(state["count"]) == 2 and torch.isnan(state["values"][2])
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    with pytest.raises(ValueError,
                       match="window of \\(8,\\) values, but this detector has window=16"):
        SpikeDetector(window=16, warmup=2).load_state_dict(state)


def planted_series() -> list[float]:
    """A training curve (fast fall, then a slow one) with 4 % noise, a NaN, an Inf, and planted
    spikes from 1.5x to 40x, some of them on consecutive steps."""
    g = torch.Generator().manual_seed(3)
    t = torch.arange(400, dtype=torch.float64)
    curve = 2.5 * torch.exp(-t / 120) + 0.4
    values = (curve * (1 + 0.04 * torch.randn(400, generator=g, dtype=torch.float64))).tolist()
    for at, factor in {30: 10.0, 57: 3.0, 130: 6.0, 131: 6.0, 132: 1.5, 250: 2.0, 333: 40.0,
                       399: 1.8}.items():
        values[at] *= factor
    values[200], values[201] = float("nan"), float("inf")
    return values


# Pinned with the detector as it was before its statistics were refreshed less often (issue
# 27): the steps it flagged on the planted series, at every step's fresh statistics.
PLANTED_FLAGGED = [30, 57, 130, 131, 333, 399]


@pytest.mark.parametrize("refresh_every", [1, 10, 25])  # 25: the loop's, at the defaults
def test_the_planted_series_flags_the_same_steps_as_before(refresh_every):
    found = flags(SpikeDetector(window=100, warmup=20, refresh_every=refresh_every),
                  planted_series())
    assert [i for i, f in enumerate(found) if f] == PLANTED_FLAGGED


def test_statistics_refresh_at_each_update_until_the_window_is_full_then_every_refresh_every():
    d = SpikeDetector(window=4, warmup=2, refresh_every=3)
    assert flags(d, [1.0, 1.0]) == [False] * 2  # warming up: the limit is +inf
    assert flags(d, [1.08, 1.08]) == [False] * 2  # filling: fresh statistics at each update
    # Updates 5-7 are compared with the statistics of updates 1-4 (median 1.0, limit 1.089): the
    # second 1.15 is a spike although the 1.08 before it, once in the window, would pass it.
    assert flags(d, [1.15, 1.08, 1.15]) == [True, False, True]
    assert flags(d, [1.15]) == [False]  # refreshed: median 1.08, limit 1.176
    assert int(d.state_dict()["count"]) == 6


def test_state_saved_between_refreshes_resumes_with_identical_decisions():
    history, future = noisy(75, seed=1), noisy(40, seed=2)
    future[5], future[25] = 3.0, 9.0
    uninterrupted = SpikeDetector(window=32, warmup=16, refresh_every=7)
    flags(uninterrupted, history)  # 75 - 16 = 59 updates after warmup: 3 pending
    buffer = io.BytesIO()
    torch.save(uninterrupted.state_dict(), buffer)
    buffer.seek(0)
    resumed = SpikeDetector(window=32, warmup=16, refresh_every=7)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    expected = flags(uninterrupted, future)
    assert flags(resumed, future) == expected and expected[5] and expected[25]
    a, b = resumed.state_dict(), uninterrupted.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_state_saved_before_the_limit_was_kept_still_loads():
    d = SpikeDetector(window=16, warmup=4)
    flags(d, noisy(20))
    old = {k: v for k, v in d.state_dict().items() if k in ("values", "count")}
    resumed = SpikeDetector(window=16, warmup=4)
    resumed.load_state_dict(old)
    assert flags(resumed, [2.0, 30.0]) == flags(d, [2.0, 30.0]) == [False, True]
    g = SpikeDetector(window=16, warmup=4)  # two such states load into a detector of two series
    flags(g, noisy(20, level=5.0, seed=9))
    saved = {"loss": old, "grad_norm": {k: g.state_dict()[k] for k in old}}
    both = SpikeDetector(window=16, warmup=4, series=("loss", "grad_norm"))
    both.load_state_dict(saved)
    apart = [SpikeDetector(window=16, warmup=4), SpikeDetector(window=16, warmup=4)]
    for d, name in zip(apart, saved):
        d.load_state_dict(saved[name])
    values = torch.tensor([[30.0, 5.0], [2.0, 50.0], [2.1, 5.1]])
    got = both.update_many(values)
    assert torch.equal(got, torch.stack([d.update_many(values[:, i]) for i, d in enumerate(apart)], 1))
    assert got.tolist() == [[True, False], [False, True], [False, False]]
    assert all(same_state(both.state_dict()[name], d.state_dict())
               for name, d in zip(saved, apart))


@pytest.mark.parametrize("kwargs", [{"window": 0}, {"window": 5, "warmup": 6}, {"warmup": 0},
                                    {"threshold": 0.0}, {"min_rel_mad": -1.0},
                                    {"refresh_every": 0}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="spike detector"):
        SpikeDetector(**kwargs)


def state_equal(a: SpikeDetector, b: SpikeDetector) -> bool:
    """Bit for bit, the window's empty (NaN) slots included."""
    return same_state(a.state_dict(), b.state_dict())


def same_state(x: dict, y: dict) -> bool:
    """Two state_dicts bit for bit (dtypes and shapes too), the empty (NaN) slots included."""
    return x.keys() == y.keys() and all(
        x[k].dtype == y[k].dtype and torch.equal(torch.nan_to_num(x[k], nan=-7.0),
                                                 torch.nan_to_num(y[k], nan=-7.0)) for k in x)


@pytest.mark.parametrize("refresh_every", [1, 7, 25])
@pytest.mark.parametrize("chunk", [1, 13, 100, 400])
def test_update_many_flags_and_keeps_exactly_what_one_update_per_value_does(refresh_every, chunk):
    """The raise and rollback policies compare a log interval's values at its log point in one
    `update_many` (issue 35): the same flags, bit for bit the same state, wherever the chunks
    fall against the warm-up, the filling window and the refreshes (the planted series holds
    spikes, a NaN and an Inf)."""
    values = planted_series()
    one = SpikeDetector(window=100, warmup=20, refresh_every=refresh_every)
    many = SpikeDetector(window=100, warmup=20, refresh_every=refresh_every)
    expected = flags(one, values)
    got: list[bool] = []
    alongside = SpikeDetector(window=100, warmup=20, refresh_every=refresh_every)
    for start in range(0, len(values), chunk):
        got += many.update_many(torch.tensor(values[start:start + chunk])).tolist()
        flags(alongside, values[start:start + chunk])
        assert state_equal(many, alongside), f"state after value {start + chunk}"
    assert got == expected
    assert [i for i, f in enumerate(got) if f] == PLANTED_FLAGGED
    assert torch.equal(many.last_limit, one.last_limit)


def test_update_many_and_update_interleave_and_an_empty_batch_changes_nothing():
    values = noisy(90, seed=4)
    values[60] = 9.0
    one, mixed = SpikeDetector(window=32, warmup=8, refresh_every=5), \
        SpikeDetector(window=32, warmup=8, refresh_every=5)
    expected = flags(one, values)
    got = mixed.update_many(torch.tensor(values[:41])).tolist() + flags(mixed, values[41:58])
    assert mixed.update_many(torch.zeros(0)).tolist() == []
    got += mixed.update_many(torch.tensor(values[58:])).tolist()
    assert got == expected and got[60]
    assert state_equal(one, mixed)


# ---------------------------------------------------------------- several series, one detector

SERIES = ("loss", "grad_norm")


def pair_series(seed: int, n: int = 300) -> torch.Tensor:
    """(n, 2): a loss and a gradient norm side by side, noise around a level, with planted
    spikes of 1x to 21x on about 6 % of the values of either, and NaN, +Inf and -Inf on
    about 3 %."""
    g = torch.Generator().manual_seed(seed)
    x = 1 + 0.05 * torch.randn(n, 2, generator=g)
    spikes = torch.rand(n, 2, generator=g) < 0.06
    x[spikes] *= 1 + 20 * torch.rand(int(spikes.sum()), generator=g)
    bad = torch.rand(n, 2, generator=g) < 0.03
    which = torch.randint(0, 3, (int(bad.sum()),), generator=g)
    x[bad] = torch.tensor([float("nan"), float("inf"), float("-inf")])[which]
    return x


def states_of(detectors: list[SpikeDetector]) -> dict:
    """Two single-series detectors' states as a checkpoint holds the spike guard's."""
    return {name: d.state_dict() for name, d in zip(SERIES, detectors)}


def same_states(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)


SETTINGS = [{"window": 16, "warmup": 5, "refresh_every": 1},
            {"window": 16, "warmup": 5, "refresh_every": 3},
            {"window": 16, "warmup": 16, "refresh_every": 7},
            {"window": 100, "warmup": 20, "refresh_every": 25},  # the loop's, at the defaults
            {"window": 8, "warmup": 1, "refresh_every": 4}]


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("chunk", [0, 1, 7, 100, 300])  # 0: `update`, one step at a time
def test_two_series_in_one_detector_flag_and_keep_exactly_what_two_detectors_do(settings, chunk):
    """The spike guard watches the loss and the gradient norm with one detector of two series
    (one set of operators for both): after every update, the flags, each series' state and
    the limits are those of a detector per series, bit for bit, through the warm-up, the
    filling window, the ring's wrap, NaN and Inf, and spikes kept out of the window."""
    x = pair_series(SETTINGS.index(settings))
    both = SpikeDetector(**settings, series=SERIES)
    apart = [SpikeDetector(**settings), SpikeDetector(**settings)]
    found = []
    for start in range(0, len(x), chunk or 1):
        part = x[start:start + (chunk or 1)]
        if chunk:
            got = both.update_many(part)
            expected = torch.stack([d.update_many(part[:, i]) for i, d in enumerate(apart)], 1)
        else:
            got = both.update(part[0]).unsqueeze(0)
            expected = torch.stack([d.update(part[0, i]) for i, d in enumerate(apart)]).unsqueeze(0)
        assert got.dtype == torch.bool and torch.equal(got, expected), f"values {start}-"
        assert same_states(both.state_dict(), states_of(apart)), f"after value {start}"
        assert both.last_limit is not None
        assert torch.equal(both.last_limit, torch.stack([d.last_limit for d in apart]))
        found.append(got)
    flagged = torch.cat(found)
    assert flagged[:, 0].any() and flagged[:, 1].any() and not flagged.all(0).any()


@pytest.mark.parametrize("saved_by", ["two detectors", "one detector"])
def test_a_state_saved_mid_refresh_resumes_exactly_in_either_layout(saved_by):
    """A checkpoint holds each series' state as a detector of its own gives it (the layout of
    the two detectors of before): saved by either, in the middle of a refresh period, it
    resumes into either with the flags and state of the uninterrupted run."""
    settings = {"window": 32, "warmup": 8, "refresh_every": 7}
    x = pair_series(7, 160)
    uninterrupted = SpikeDetector(**settings, series=SERIES)
    uninterrupted.update_many(x[:79])  # refreshed at update 75 (every 7 once the window filled)
    if saved_by == "two detectors":
        first = [SpikeDetector(**settings), SpikeDetector(**settings)]
        for i, d in enumerate(first):
            d.update_many(x[:79, i])
        saved = states_of(first)
    else:
        saved = SpikeDetector(**settings, series=SERIES)
        saved.update_many(x[:79])
        saved = saved.state_dict()
    assert same_states(saved, uninterrupted.state_dict())
    assert [int(saved[name]["due"]) for name in SERIES] == [2, 2]  # updates 75-79 not in the window yet
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    both = SpikeDetector(**settings, series=SERIES)
    both.load_state_dict(loaded)
    apart = [SpikeDetector(**settings), SpikeDetector(**settings)]
    for name, d in zip(SERIES, apart):
        d.load_state_dict(loaded[name])
    expected = torch.stack([uninterrupted.update(v) for v in x[79:90]] +
                           list(uninterrupted.update_many(x[90:])))
    assert torch.equal(torch.stack([both.update(v) for v in x[79:90]] +
                                   list(both.update_many(x[90:]))), expected)
    assert torch.equal(torch.stack([d.update_many(x[79:, i]) for i, d in enumerate(apart)], 1),
                       expected)
    assert expected[:, 0].any() and expected[:, 1].any()
    assert same_states(both.state_dict(), uninterrupted.state_dict())
    assert same_states(states_of(apart), uninterrupted.state_dict())
    # each series' window a tensor of its own: a view of the two-series window saves all of it
    assert all(state["values"].untyped_storage().nbytes() == 32 * 4
               for state in both.state_dict().values())


def test_two_series_compare_and_refresh_without_a_host_sync():
    d = SpikeDetector(window=16, warmup=4, refresh_every=3, series=SERIES)
    x = pair_series(5, 60)
    x[-1, 1] = 30.0
    with HostSyncCounter() as counter:
        out = [d.update(v) for v in x[:30]] + list(d.update_many(x[30:]))
        d.state_dict()
    assert counter.count == 0, counter.sites
    assert out[-1].tolist() == [False, True] and d.last_limit is not None
    assert d.last_limit.shape == (2,)


def test_two_series_cost_the_operators_of_one():
    """Each comparison and each refresh is one set of operators for all the series: a detector
    of two dispatches what a detector of one does (counted, not timed)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    def counted(series, values):
        d = SpikeDetector(window=100, warmup=20, refresh_every=25, series=series)
        d.update_many(values[:150])  # warmed up, the window filling
        Count.ops = 0
        with Count():
            d.update(values[150])  # a refresh, then a comparison
            d.update_many(values[151:250])  # four comparisons, four refreshes
        return Count.ops

    x = pair_series(3)
    assert counted(SERIES, x) == counted((), x[:, 0]) > 0


def test_several_series_refuse_values_and_states_that_do_not_fit():
    d = SpikeDetector(window=8, warmup=2, series=SERIES)
    with pytest.raises(ValueError, match=r"expected one value per series \['loss', 'grad_norm'\], "
                                         r"got shape \(3,\)"):
        d.update(torch.ones(3))
    with pytest.raises(ValueError, match=r"per update, got shape \(4, 3\)"):
        d.update_many(torch.ones(4, 3))
    assert d.update_many(torch.zeros(0, 2)).shape == (0, 2)
    one = SpikeDetector(window=8, warmup=2)
    one.update_many(torch.ones(3))
    with pytest.raises(ValueError, match=r"holds no series \['grad_norm'\]"):
        d.load_state_dict({"loss": one.state_dict()})
    other = SpikeDetector(window=8, warmup=2)
    other.update_many(torch.ones(4))
    with pytest.raises(ValueError, match="not updated together"):
        d.load_state_dict({"loss": one.state_dict(), "grad_norm": other.state_dict()})
    with pytest.raises(ValueError, match="must differ"):
        SpikeDetector(series=("loss", "loss"))
