"""How the ranks agree on what the loop does next: the strategy's `agreement`, which the loop
calls at named points.

- `rank_local(control)`: a callback request made between log points (after each step).
- `stop_votes(signals)` / `count_stop_votes(metrics, signals)`: at a log point, this rank's stop
  signal rides on the metrics' one collective; the sum says whether any rank got one.
- `agreed(control)`: at a log point or validation, the callbacks' requests agreed across ranks.
- `stop_agreed(signals)`: after each step, whether every rank leaves the loop now.

`LocalAgreement` is one process's (every request acts at once); `RankAgreement` is a torchrun
job's, where background work the ranks must complete together (an asynchronous sharded save)
registers with `complete_together` and rides on the same votes. `MeshAgreement` is a device
mesh's: the metrics are reduced over the data dimension only, so the votes take a collective
of their own over every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Protocol

import torch

from ..callbacks import Control, _merge
from .. import distributed
from ..distributed import all_reduce

if TYPE_CHECKING:
    from ..preemption import StopSignals


def agree(control: Optional[Control], device: torch.device) -> Optional[Control]:
    """Under torchrun: every rank's requests ORed together, the same on every rank (one
    collective of three flags and one host read). In a single process: `control`."""
    if not distributed.dist.is_initialized() or distributed.dist.get_world_size() == 1:
        return control
    c = control or Control()
    flags = torch.tensor([c.stop, c.evaluate, c.save], dtype=torch.float32).to(device)
    stop, evaluate, save = (v > 0 for v in all_reduce(flags, "max").tolist())
    return Control(stop=stop, evaluate=evaluate, save=save) if stop or evaluate or save else None


class Background(Protocol):
    """Work every rank does in the background, completed together (a `ShardedWriter`)."""

    def written(self) -> Optional[bool]:
        """Whether this rank's part is done (None: nothing in flight)."""

    def finish(self) -> None:
        """Every rank: complete it (waits for this rank's part)."""


class LocalAgreement:
    """One process: every request acts at once, a stop signal is this process's own."""

    def rank_local(self, control: Optional[Control]) -> Optional[Control]:
        return control

    def agreed(self, control: Optional[Control]) -> Optional[Control]:
        return control

    def stop_votes(self, signals: "StopSignals") -> dict[str, torch.Tensor]:
        return {}

    def count_stop_votes(self, metrics: dict[str, float], signals: "StopSignals") -> None:
        pass

    def stop_agreed(self, signals: "StopSignals") -> bool:
        """A stop signal arrived."""
        return signals.received is not None


class RankAgreement(LocalAgreement):
    """Under torchrun: every control-flow decision agreed across ranks, so that every rank
    leaves the loop, validates and saves at the same step."""

    def __init__(self, device: torch.device, world_size: int) -> None:
        self._device, self._world_size = device, world_size
        self._pending: Optional[Control] = None  # requests not yet agreed
        self._agreed_signal: Optional[int] = None
        self._background: Optional[Background] = None

    def complete_together(self, work: Background) -> None:
        """Complete `work` at the first log point after every rank's part is done: whether it
        is done is summed with the stop votes, at no extra collective."""
        self._background = work

    def rank_local(self, control: Optional[Control]) -> Optional[Control]:
        """A request made between log points (on_train_step_end) waits for the next log point
        or validation, where the ranks agree on it."""
        self._pending = _merge(self._pending, control)
        return None

    def agreed(self, control: Optional[Control]) -> Optional[Control]:
        """The callbacks' requests, agreed across ranks (any rank's request counts for all:
        a logger, for one, lives on rank 0 only)."""
        pending, self._pending = _merge(self._pending, control), None
        return agree(pending, self._device)

    def stop_votes(self, signals: "StopSignals") -> dict[str, torch.Tensor]:
        """This rank's stop signal, summed over ranks with the log metrics; while background
        work is in flight, also whether this rank's part is done."""
        signum = signals.received or 0
        votes = {"_stop_votes": torch.full((), float(signum > 0), device=self._device),
                 "_stop_signals": torch.full((), float(signum), device=self._device)}
        written = self._background.written() if self._background is not None else None
        if written is not None:  # the same on every rank: the work began on all of them
            votes["_saves_written"] = torch.full((), float(written), device=self._device)
        return votes

    def count_stop_votes(self, metrics: dict[str, float], signals: "StopSignals") -> None:
        written = metrics.pop("_saves_written", None)
        votes, signum = metrics.pop("_stop_votes", 0.0), metrics.pop("_stop_signals", 0.0)
        if votes:
            self._agreed_signal = int(round(signum / votes))
            signals.received = self._agreed_signal  # also on ranks that got none
        if written == self._world_size:
            self._background.finish()  # type: ignore[union-attr]  # every rank's part is done

    def stop_agreed(self, signals: "StopSignals") -> bool:
        """The ranks agreed on a stop signal at the last log point, so that all of them save
        the same step and exit together."""
        return self._agreed_signal is not None


class MeshAgreement(RankAgreement):
    """On a device mesh the log metrics are reduced over the data dimension only (the ranks of
    one tensor-parallel group hold the same values), which a stop signal or a finished write on
    any rank must still reach: the votes are summed over every rank in a collective of their
    own, at log points only (three numbers)."""

    def stop_votes(self, signals: "StopSignals") -> dict[str, torch.Tensor]:
        return {}  # not on the metrics' collective: see count_stop_votes

    def count_stop_votes(self, metrics: dict[str, float], signals: "StopSignals") -> None:
        votes = super().stop_votes(signals)
        summed = all_reduce(torch.stack(list(votes.values()))).tolist()  # every rank: one read
        super().count_stop_votes(dict(zip(votes, summed)), signals)
