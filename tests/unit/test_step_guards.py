"""The in-loop guards' registry (guards/step_guards.py): a guard is called at the hooks it has,
in registration order, until it says it is done; an object with no hook is refused."""

import pytest

from saferun.guards.step_guards import StepGuards


class Watch:
    def __init__(self, name, calls, done_after=None):
        self.name, self.calls, self.done_after = name, calls, done_after

    def after_backward(self, step):
        self.calls.append((self.name, step))
        return self.done_after is not None and step >= self.done_after


class AtLogPoint:
    def at_log_point(self, extra):
        extra["train/x"] = 1


def run_steps(guards, steps):
    for step in steps:  # as the step drivers do
        for check in guards.after_backward:
            if check(step):
                guards.drop(check)


def test_hooks_are_called_in_order_and_a_guard_that_is_done_is_dropped():
    calls = []
    guards = StepGuards()
    guards.register(Watch("a", calls))
    guards.register(Watch("b", calls, done_after=2))
    guards.register(AtLogPoint())
    run_steps(guards, [1, 2, 3])
    assert calls == [("a", 1), ("b", 1), ("a", 2), ("b", 2), ("a", 3)]
    assert guards.before_step == () and len(guards.at_log_point) == 1
    extra = {}
    for add in guards.at_log_point:
        add(extra)
    assert extra == {"train/x": 1}


def test_an_object_without_a_step_guard_hook_is_refused_naming_the_hooks():
    with pytest.raises(TypeError, match="has none of the step guard hooks .*after_backward"):
        StepGuards().register(object())
