"""What `self.optimize(name, loss)` refuses or explains, in the user's terms (loop/manual.py
drives the step): a loss that cannot train optimizer `name`, and the two usual slips that
autograd reports in its own words from optimize()'s backward:

- the ordering slip: a loss built before an earlier optimize() of the same step changed, in
  place, weights its graph saved (a GAN's generator loss built through the discriminator
  before the discriminator's update);
- a shared graph: two losses share part of one graph (a shared trunk or feature tensor, one
  loss given to two optimizers), and the earlier backward freed what the later one needs.

Nothing here runs per step except the cheap checks of the loss (no host read): the slips are
recognised only after backward has failed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, Optional, Sequence

import torch

from ..errors import ExplainedRuntimeError, SaferunError
from ..text import short
from .steps import _not_a_loss

_INPLACE = "modified by an inplace operation"
_FREED = "backward through the graph a second time"
# "...: [torch.FloatTensor [16, 3]], which is output 0 of AsStrided, is at version 2; expected"
# (a parameter is a leaf, named without "which is output", or a view of one, "of AsStrided")
_SAVED = re.compile(r"\[\S+ \[([\d, ]*)\]\](?:, which is output \d+ of (\w+),)? is at "
                    r"version (\d+); expected version")

Named = Sequence[tuple[str, torch.Tensor]]  # (parameter name, parameter)


def checked_loss(name: str, loss: Any, step: int) -> torch.Tensor:
    """The loss given to optimize(name, loss), if it can train optimizer `name`; else why not."""
    call = f"self.optimize({name!r}, loss)"
    if isinstance(loss, Mapping):
        raise SaferunError(f"step {step}: {call} got a dict; pass the loss tensor itself (return "
                           f"other values to log from training_step, as a dict of scalars).")
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        got, fix = _not_a_loss(loss)
        raise SaferunError(f"step {step}: {call} needs a scalar loss tensor; got {got}. {fix}")
    if not loss.requires_grad:
        raise SaferunError(
            f"step {step}: the loss given to {call} does not require grad, so backward() cannot "
            f"train optimizer {name!r}. Was it computed under torch.no_grad(), detached, or "
            f"from frozen parameters only?")
    return loss


def graph_slip(exc: RuntimeError, name: str, step: int, earlier: Mapping[str, Named]
               ) -> Optional[ExplainedRuntimeError]:
    """optimize(name)'s backward raised `exc`; `earlier`: the optimizers that optimize() already
    stepped in this step, with their parameters. The explained error (raise it `from exc`)
    if it is one of the two slips, else None."""
    message = str(exc)
    if not earlier or (_INPLACE not in message and _FREED not in message):
        return None
    call, before = f"self.optimize({name!r}, loss)", _calls(earlier)
    if _FREED in message:
        what = (f"its backward goes through part of a graph that {before} already "
                f"backpropagated through in this step (backward frees a graph's saved values "
                f"as it goes): two losses share that part (a shared trunk or feature tensor, "
                f"or one loss given to two optimizers).")
        fix = (f"(1) compute the later loss after the previous optimize() call, with a fresh "
               f"forward of the shared part (the sequential update most algorithms mean); "
               f"(2) if the later loss should not train through the shared part, .detach() "
               f"the shared tensor in it (an actor's advantage, a value target); (3) to take "
               f"both gradients from this one forward, pass retain_graph=True to the earlier "
               f"call (self.optimize({list(earlier)[-1]!r}, loss, retain_graph=True)): saferun marks each "
               f"optimizer's parameters as changed after its step, so a retained graph that "
               f"needs values a step changed is refused, never used stale; (4) one loss over "
               f"parameters split only for different settings: one optimizer with parameter "
               f"groups.")
    else:
        stepped = _stepped_params(message, earlier)
        if not stepped:
            return None  # an in-place operation in the user's code: diagnose/explain.py names it
        owners = {owner: params for owner, params in earlier.items()
                  if any(n in stepped for n, _ in params)}
        what = (f"its loss was computed before {_calls(owners)} ran, and its backward needs "
                f"the values of {short(stepped, 4)}, which that update has since changed in "
                f"place; the gradient would mix the weights before and after the update.")
        fix = (f"compute each loss after the previous optimize() call: here build the loss for "
               f"{name!r} (its forward through those parameters) after {_calls(owners)}, as the "
               f"GAN in saferun's docs (Several optimizers) does. retain_graph=True does not change "
               f"this: the update still changed values the graph saved.")
    first = message.splitlines()[0] if message else type(exc).__name__
    error = ExplainedRuntimeError(
        f"step {step}: {call} failed: {what}\n  what to do: {fix}\n"
        f"  original error: {type(exc).__name__}: {first}")
    error.original = exc
    return error


def _stepped_params(message: str, earlier: Mapping[str, Named]) -> list[str]:
    """The earlier optimizers' parameters that can be the tensor autograd names: a leaf or a
    view of one with the same number of elements (it may name a transposed view) at the
    version the parameter is at now (a view shares its base's version counter)."""
    found = _SAVED.search(message)
    if found is None or found.group(2) not in (None, "AsStrided"):
        return []  # the output of an operation (a user's in-place op on an activation)
    dims = [int(d) for d in found.group(1).replace(" ", "").split(",") if d]
    numel, version = math.prod(dims), int(found.group(3))
    return [n for params in earlier.values() for n, p in params
            if p.numel() == numel and p._version == version]


def _calls(names: Mapping[str, Any]) -> str:
    return ", ".join(f"self.optimize({n!r}, ...)" for n in names)
