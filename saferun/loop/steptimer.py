"""Where a step's time goes, from a cheap timer on one step per log window: perf/*_ms.

The step that ends at each log point is timed in phases with the host clock:

- perf/data_wait_ms: from the end of the step before to the batch in hand (the loader, the
  batch stream's bookkeeping);
- perf/forward_backward_ms: the batch moved to the device, training_step and the backward;
- perf/optimizer_ms: unscaling, clipping (or measuring) the gradient norm, optimizer.step,
  zero_grad, the scheduler and the GradScaler's update;
- perf/guards_ms: the per-step guards (the declared-modes check, the unused-parameter check of
  the first steps, the buffer snapshot and the verdict of a skip policy, the spike detectors);
- perf/step_ms: the whole step, from the end of the one before to its log point (so with the
  loop's bookkeeping and the callbacks' on_train_step_end, which no phase counts).

On a GPU the device is synchronized before each mark of the timed step only, so each phase is
its kernels' time and not their launches'; that step is the log point's, which reads the device
anyway. On a CPU nothing is synchronized. The other steps pay one attribute read per mark.
With several optimizers (training_step drives them) only the data wait and the step are split.
"""

from __future__ import annotations

import math
import time
from typing import Optional

import torch

PHASES = ("data_wait", "forward_backward", "optimizer", "guards")


class StepTimer:
    """Times the phases of the step that ends at each log point (see the module docstring).

    Args:
        device: the training device (CUDA: synchronized at each mark of the timed step).
        every: trainer.log_every_n_steps.
        phases: split the compute phases (False with several optimizers, whose training_step
            interleaves them: only the data wait and the step are then reported).
    """

    def __init__(self, device: torch.device, every: int, phases: bool = True) -> None:
        self.on = False  # the step running now is timed: its marks record (read per mark)
        self.before = -1  # the loop starts the timer after this step: the next one is timed
        self._every, self._phases = every, phases
        self.limit = math.inf  # trainer.max_steps of the fit
        self._sync = device.type == "cuda"
        self._device = device
        self._step = 0  # the step timed
        self._last = 0.0
        self._started = 0.0
        self._times: dict[str, float] = {}

    def plan(self, step: int, limit: Optional[float], starting: bool = False) -> None:
        """After step `step` (a fit's start, a log point): time the next step that ends at a log
        point, or the run's last step `limit` (None: not known), whichever comes first. The
        loop starts the timer once the step before it has ended (its validation and save too);
        `starting`: a fit starts here, so if the timed step is the next one, it starts now."""
        self.on = False
        self.limit = math.inf if limit is None else limit
        timed = min((step // self._every + 1) * self._every, self.limit)
        self.before = int(timed) - 1 if timed != math.inf else -1
        if starting and self.before == step:
            self.start(step)

    def start(self, step: int) -> None:
        """Step `step` has ended: the wait for the next one's data begins."""
        self._step, self._times = step + 1, {}
        self._started = self._last = self._now()
        self.on = True

    def lap(self, phase: str) -> None:
        """The time since the last mark went to `phase` (called only while `on`)."""
        if phase == "data_wait" and self._times:  # a second step since start(): not timed
            self.on = False  # (a rollback went back past this log point)
            return
        if not self._phases and phase != "data_wait":
            return
        now = self._now()
        self._times[phase] = self._times.get(phase, 0.0) + (now - self._last)
        self._last = now

    def at_log_point(self, metrics: dict[str, float], step: int) -> None:
        """Add the timed step's perf/*_ms to `metrics`, when that step is `step` (a rollback
        or a run that ended early leaves none), and plan the next."""
        if self.on and self._step == step:
            end = self._now()
            for phase in PHASES:
                if phase in self._times:
                    metrics[f"perf/{phase}_ms"] = 1e3 * self._times[phase]
            metrics["perf/step_ms"] = 1e3 * (end - self._started)
        self.plan(step, self.limit)

    def _now(self) -> float:
        if self._sync:
            torch.cuda.synchronize(self._device)
        return time.perf_counter()
