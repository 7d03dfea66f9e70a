"""What the whole loop costs around the step, in counts that do not depend on the machine's load:
Python calls per step (`sys.setprofile`) against the hand-written loop of
benchmarks/loop_window.py, over a window of plain steps (no log point, no checkpoint)."""

import copy
import os
import sys

import pytest

import saferun
from helpers import assert_equal_nested
from toys import ToyTrainer, toy_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# saferun's own work per plain step beyond the hand loop's (batch size, device move, the
# step frame, the declared-modes check, the bookkeeping, the callbacks' dispatch, the stop
# checks), counted against the `lean` hand loop, which clips and zeroes the way saferun does
# (torch's kernels, without clip_grad_norm_'s and zero_grad's 86 calls of general-purpose work):
# 19 calls today (26 over the plain hand loop before saferun clipped directly, 30 before the
# step's end decided validation and saves itself, 41 before issue 37's step frame, 60 before
# issue 37), with one call of slack, so that per-step work added by mistake, even one object
# built per step, fails here. Lower it when the loop gets leaner.
EXTRA_CALLS_PER_STEP = 20
# guards=strict's three guards work at log points and saves only (the spike guard compares the
# steps there, issue 35: it was 3 calls, its call and two detector updates)
STRICT_EXTRA_OVER_DEFAULTS = 0
# Container objects a plain step leaves alive until its log point (the collector's generation-0
# count, which triggers collections), beyond the hand loop's 1: the sample indices with their
# epoch (a tuple, a list, the sampler's list). The loss and the gradient norm are written into
# one preallocated tensor (loop/metrics.py): kept as tensors, they were 2 more, and cost about
# 30,000 instructions per step in the allocator and at the log point's stack.
EXTRA_KEPT_PER_STEP = 3
STRICT_KEPT_OVER_DEFAULTS = 0  # (4 while the spike flags and the detectors' values were per step)
# guards=strict's torch operators per log interval of 100 steps, all at its log point: the spike
# guard's four refreshes (31 operators each) and comparisons, one set of operators for the loss
# and the gradient norm (two series of one detector; 326 with a detector each), and the
# parameter norm (9). Counts, the same on any machine: lower it when the log point gets leaner.
STRICT_OPS_PER_LOG_INTERVAL = 153
# A skip policy compares each step before its update: the loss and the gradient norm stacked,
# nan_to_num, the comparison, and the two flags (the loss's, either's): as with a detector each.
SPIKE_OPS_PER_COMPARED_STEP = 5


@pytest.fixture
def loop_window(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    import loop_window

    return loop_window


def plain_step_counts(loop_window, variant, tmp_path, steps=230, start=120):
    """(Python calls, container objects kept) per plain step of the window."""
    window = loop_window.Window(start, steps, "calls", kept=True)
    if variant in ("hand", "lean"):
        loop_window.hand_loop(steps, window, lean=variant == "lean")
    else:
        guards = loop_window.STRICT if variant == "strict" else {}
        loop_window.saferun_loop(steps, window, guards, str(tmp_path / variant))
    assert window.step == steps
    counted = window.result()
    return counted["plain_step_python_calls"], counted["plain_step_kept_objects"]


def test_the_loop_adds_few_python_calls_and_keeps_few_objects_per_step(loop_window, tmp_path):
    # exact counts, independent of the machine (the objects: the collector paused over the window)
    (hand, _), (lean, hand_kept), (defaults, kept), (strict, strict_kept) = (
        plain_step_counts(loop_window, v, tmp_path / v) for v in ("hand", "lean", "saferun", "strict"))
    assert lean > 300 and hand_kept >= 1  # the window counted (forward, backward, AdamW, the loader)
    assert defaults - lean <= EXTRA_CALLS_PER_STEP, (defaults, lean)
    # the clipping and zeroing's general-purpose work is gone from saferun's step (loop/update.py)
    assert hand - defaults >= 60, (hand, defaults)
    assert strict - defaults <= STRICT_EXTRA_OVER_DEFAULTS, (strict, defaults)
    assert kept - hand_kept <= EXTRA_KEPT_PER_STEP, (kept, hand_kept)
    assert strict_kept - kept <= STRICT_KEPT_OVER_DEFAULTS, (strict_kept, kept)


def test_strict_guards_dispatch_no_torch_operator_on_a_plain_step(loop_window):
    # guards.spikes=raise compares a log interval's steps at its log point: a plain step
    # dispatches the operators of the defaults' step (on a GPU each is a kernel launch), and
    # neither reads the device
    import torch

    threads = torch.get_num_threads()
    try:
        counted = {v: loop_window.child(v, "device", 230, 120) for v in ("saferun", "strict")}
    finally:
        torch.set_num_threads(threads)
    assert counted["saferun"]["plain_step_torch_ops"] > 50  # forward, backward, AdamW counted
    assert counted["strict"]["plain_step_torch_ops"] == counted["saferun"]["plain_step_torch_ops"]
    assert counted["strict"]["syncs_between_log_points"] == 0
    assert counted["strict"]["final_loss"] == counted["saferun"]["final_loss"]
    # the window, steps 121-230, holds one log point (step 200)
    at_log_point = round((counted["strict"]["torch_ops"] - counted["saferun"]["torch_ops"]) * 110)
    assert 0 < at_log_point <= STRICT_OPS_PER_LOG_INTERVAL, at_log_point


def test_a_step_compared_by_the_spike_guard_dispatches_five_operators(loop_window, monkeypatch):
    # guards.nonfinite=skip makes every step wait for its verdict; guards.spikes=rollback then
    # compares each step as it comes (StepOutput.spike) without adding to the verdict: the
    # difference is the comparison alone
    import torch

    threads = torch.get_num_threads()
    counted = {}
    try:
        for spikes in ("off", "rollback"):
            monkeypatch.setattr(loop_window, "STRICT", {"nonfinite": "skip", "spikes": spikes})
            counted[spikes] = loop_window.child("strict", "device", 230, 120)
    finally:
        torch.set_num_threads(threads)
    assert counted["rollback"]["plain_step_torch_ops"] - counted["off"]["plain_step_torch_ops"] \
        == SPIKE_OPS_PER_COMPARED_STEP
    assert counted["rollback"]["final_loss"] == counted["off"]["final_loss"]  # nothing spiked


class _StepCalls(saferun.Callback):
    """The Python functions called during step `at` (from the end of the step before to the end
    of this one), as (file name, function name)."""

    def __init__(self, at: int) -> None:
        self.at, self.called = at, set()

    def on_train_step_end(self, view, output):
        if view.step == self.at - 1:
            sys.setprofile(self._profile)
        elif view.step == self.at:
            sys.setprofile(None)

    def _profile(self, frame, event, arg):
        if event == "call":
            self.called.add((os.path.basename(frame.f_code.co_filename), frame.f_code.co_name))


def test_a_default_step_calls_no_guard_or_context_it_does_not_need(tmp_path):
    # One process in fp32 with the default guards, after the first steps: no context entered
    # (strategy.micro_batch, autocast), no GradScaler call (disabled outside fp16), none of the
    # first steps' checks (loop/frame.py) and no guard hook the config leaves off; the step
    # guards that are on (declared modes) run (guards/step_guards.py).
    probe = _StepCalls(at=30)
    ToyTrainer(toy_config(tmp_path, max_steps=40), callbacks=[probe]).fit()
    files = {file for file, _ in probe.called}
    names = {name for _, name in probe.called}
    assert "training_step" in names, probe.called  # it profiled the step
    assert "contextlib.py" not in files and "grad_scaler.py" not in files, sorted(probe.called)
    assert not {"_checked", "_counted", "micro_batch", "before_step", "at_log_point"} & names
    assert ("unused.py", "after_backward") not in probe.called  # done after its window (20 steps)
    assert "model_audit.py" not in files and "loss_audit.py" not in files
    assert ("modes.py", "after_backward") in probe.called  # guards.declared_modes is on


class _AccumulatorHooks(saferun.Callback):
    """After step 2, a pre-hook on each parameter's gradient accumulator, holding none of them:
    the hooks fire at later steps only if those steps' backwards reuse the same accumulators."""

    def __init__(self) -> None:
        self.model = None
        self.fired = 0

    def on_train_step_end(self, view, output):
        if view.step == 2:
            for p in self.model.parameters():
                node = p.view_as(p).grad_fn.next_functions[0][0]
                node.register_prehook(self._count)

    def _count(self, grad_outputs):
        self.fired += 1


def test_the_gradient_accumulators_live_across_steps(tmp_path):
    # A hand-written loop keeps each parameter's accumulator node alive by accident (its `loss`
    # holds the last graph); without saferun holding them, every step builds them again and
    # every optimizer op on a parameter hands its Python reference over (loop/update.py).
    probe = _AccumulatorHooks()
    trainer = ToyTrainer(toy_config(tmp_path, max_steps=6), callbacks=[probe])
    trainer.setup()
    probe.model = trainer.model
    trainer.fit()
    params = len(list(trainer.model.parameters()))
    assert params >= 2
    assert probe.fired == params * 4, (probe.fired, params)  # steps 3 to 6, each parameter


class _HookedOnItself(ToyTrainer):
    """A gradient hook on each parameter that refers to the Trainer (a task's own scaling)."""

    def build_model(self):
        model = super().build_model()
        for p in model.parameters():
            p.register_hook(lambda g: g * (self.cfg.trainer.batch_size / 32))
        return model


def test_a_finished_trainer_whose_hooks_refer_to_it_is_freed(tmp_path):
    # The held accumulators (C++ nodes, which the garbage collector cannot see into) hold the
    # parameters, whose hooks hold the Trainer: held past fit(), every such Trainer stayed in
    # memory with its model, optimizer and loaders (a sweep in one process, a notebook)
    import gc
    import weakref

    def run(where):
        t = _HookedOnItself(toy_config(where, max_steps=3))
        t.fit()
        return weakref.ref(t), weakref.ref(t.model)

    refs = run(tmp_path / "a") + run(tmp_path / "b")
    gc.collect()
    assert [r() for r in refs] == [None] * 4


def _trained(where, holder, monkeypatch, **trainer):
    """A run of 4 steps, then a second fit() to 8, with gradient hooks registered before the
    first fit and after it; (weights, optimizer state, how often each hook kind fired)."""
    import saferun.trainer as trainer_module

    if not holder:
        monkeypatch.setattr(trainer_module, "grad_accumulators", lambda params: [])
    fired = {"before": 0, "after": 0, "accumulated": 0}

    def count(kind, scale=1.0):
        def hook(g):
            fired[kind] += 1
            return g * scale
        return hook

    def count_accumulated(p):
        fired["accumulated"] += 1

    t = ToyTrainer(toy_config(where, max_steps=4, **trainer))
    t.setup()
    for p in t.model.parameters():
        p.register_hook(count("before", 0.5))
        p.register_post_accumulate_grad_hook(count_accumulated)
    t.fit()
    for p in t.model.parameters():
        p.register_hook(count("after", 2.0))
    t.cfg.trainer.max_steps = 8
    t.fit()
    monkeypatch.undo()
    return (copy.deepcopy(t.model.state_dict()), copy.deepcopy(t.optimizer.state_dict()), fired)


@pytest.mark.parametrize("accumulate", [1, 3])
def test_the_held_accumulators_change_no_gradient_weight_or_hook(tmp_path, monkeypatch, accumulate):
    # fit() holds each parameter's gradient accumulator (loop/update.py); the user's tensor
    # hooks, registered before fit() and between two fits, must fire and scale as without it
    held = _trained(tmp_path / "held", True, monkeypatch, accumulate=accumulate)
    plain = _trained(tmp_path / "plain", False, monkeypatch, accumulate=accumulate)
    assert_equal_nested(held[0], plain[0], "model")  # parameters and buffers, bitwise
    assert_equal_nested(held[1], plain[1], "optimizer")  # (it compared the state's repr)
    assert held[2] == plain[2]
    if accumulate == 1:  # Net: two Linear layers and a BatchNorm, a weight and a bias each
        assert held[2] == {"before": 6 * 8, "after": 6 * 4, "accumulated": 6 * 8}
