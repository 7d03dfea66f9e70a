"""The loop's counters and latest metrics (its own module, so that `callbacks` does not import
the trainer: no import cycle)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional


@dataclass
class LoopState:
    """The loop's counters and latest metrics; callbacks read it through `TrainerView`."""

    step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0
    samples_seen: int = 0
    max_steps: Optional[int] = 0  # the run's length in steps; None: not known (a stream's epochs)
    run_dir: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    rank: int = 0
    world_size: int = 1
    # the step of the last completed validation (a rollback to it does not validate again)
    validated_at: int = -1
    # a step's end that a stop interrupted (its validation): {"step", "save", "stop"}, or None
    owed: Optional[dict[str, Any]] = None

    def advance(self, samples: int) -> int:
        """One optimizer step done, its update applied or skipped (the one place the step
        counter moves forward): the new step."""
        self.step += 1
        self.samples_seen += samples
        return self.step

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint's "loop" holds of it (the Checkpointer adds save_best's best)."""
        return {"step": self.step, "epoch": self.epoch, "batches_in_epoch": self.batches_in_epoch,
                "samples_seen": self.samples_seen, "metrics": dict(self.metrics),
                # a stop interrupted this step's validation: the resumed run does it first
                "owed": self.owed if self.owed and self.owed["step"] == self.step else None,
                "validated_at": self.validated_at}

    def load_state_dict(self, loop: Mapping[str, Any]) -> None:
        """Put `state_dict()`'s result back (a checkpoint's "loop")."""
        self.load_counters(loop)
        self.metrics.update(loop["metrics"])
        self.owed = loop["owed"]
        self.validated_at = loop.get("validated_at", -1)

    def load_counters(self, loop: Mapping[str, Any]) -> None:
        """The step, epoch, position and samples of a checkpoint's "loop": where its weights are
        from (an evaluation of a resumed run's weights reports that step)."""
        for key in ("step", "epoch", "batches_in_epoch", "samples_seen"):
            setattr(self, key, loop[key])
