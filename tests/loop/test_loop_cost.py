"""What the whole loop costs around the step, in counts that do not depend on the machine's load:
Python calls per step (`sys.setprofile`) against the hand-written loop of
benchmarks/loop_window.py, over a window of plain steps (no log point, no checkpoint)."""

import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# saferun's own work per plain step beyond the hand loop's (batch size, device move, the
# guards' checks, the bookkeeping, the callbacks' dispatch, the stop checks): 41 calls today
# (60 before issue 37), with one call of slack, so that per-step work added by mistake, even
# one object built per step, fails here. Lower it when the loop gets leaner.
EXTRA_CALLS_PER_STEP = 42
STRICT_EXTRA_OVER_DEFAULTS = 3  # the spike guard's call and its two detector updates


@pytest.fixture
def loop_window(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    import loop_window

    return loop_window


def plain_step_calls(loop_window, variant, tmp_path, steps=230, start=120):
    window = loop_window.Window(start, steps, "calls")
    if variant == "hand":
        loop_window.hand_loop(steps, window)
    else:
        guards = loop_window.STRICT if variant == "strict" else {}
        loop_window.saferun_loop(steps, window, guards, str(tmp_path / variant))
    assert window.step == steps
    return window.result()["plain_step_python_calls"]


def test_the_loop_adds_few_python_calls_per_step(loop_window, tmp_path):
    hand = plain_step_calls(loop_window, "hand", tmp_path)
    defaults = plain_step_calls(loop_window, "saferun", tmp_path)
    strict = plain_step_calls(loop_window, "strict", tmp_path)
    assert hand > 300  # the window counted the steps (forward, backward, AdamW, the loader)
    assert defaults - hand <= EXTRA_CALLS_PER_STEP, (defaults, hand)
    assert strict - defaults <= STRICT_EXTRA_OVER_DEFAULTS, (strict, defaults)
