"""The in-loop guards, registered once in setup by the hooks they have.

A guard that runs inside the loop is an object with one or more of these methods; the loop
calls each hook's guards, in registration order, at its point:

    before_step()            before the step's forward (the skip policy's buffer snapshot)
    after_backward(step)     after the step's backward(s), before the update (declared modes,
                             unused parameters); `step` is the step being computed. A true
                             return value says the guard is done: it is dropped and later
                             steps no longer call it.
    at_log_point(extra)      at a log point, before the window's metrics are read: add device
                             values to `extra` ({name: tensor}); they are read with the other
                             metrics in the one host read (guards.check_params' parameter norm),
                             or refuse (the trainable set, always on: guards/trainable.py)

`Trainer.setup` registers each guard its config turns on, one line each. A hook no guard has
is an empty tuple, which the loop iterates at no Python call: the default hot path calls only
the guards that are on. (The spike detectors run inside the update, between the clip and the
optimizer step, where the skip verdict needs them: loop/update.py.)
"""

from __future__ import annotations

from typing import Any, Callable

HOOKS = ("before_step", "after_backward", "at_log_point")


class StepGuards:
    """The hooks of the registered in-loop guards, per point of the loop (tuples: a guard that
    drops out mid-iteration leaves the iteration in progress as it was)."""

    def __init__(self) -> None:
        self.before_step: tuple[Callable[[], None], ...] = ()
        self.after_backward: tuple[Callable[[int], Any], ...] = ()
        self.at_log_point: tuple[Callable[[dict[str, Any]], None], ...] = ()

    def register(self, guard: Any) -> None:
        """Call `guard`'s hooks (the methods of HOOKS it has) at their points from now on."""
        hooks = [h for h in HOOKS if callable(getattr(guard, h, None))]
        if not hooks:
            raise TypeError(f"{type(guard).__name__} has none of the step guard hooks "
                            f"({', '.join(HOOKS)}).")
        for hook in hooks:
            setattr(self, hook, getattr(self, hook) + (getattr(guard, hook),))

    def drop(self, hook: Callable[..., Any]) -> None:
        """Call `hook` no more (a guard that is done)."""
        for name in HOOKS:
            setattr(self, name, tuple(h for h in getattr(self, name) if h != hook))
