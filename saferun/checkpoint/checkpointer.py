"""The Checkpointer: which checkpoint to resume from, resuming, and saving with rotation and
save_best. The on-disk format (atomic write, manifest, verify, rotate) is `store`'s; how the
model and optimizer state goes in and out is the strategy's checkpoint format's (`formats`:
whole in state.pt, or sharded per rank).

It is given the Trainer's public state (the `Owner` protocol: config, the loop's `LoopState`,
ranks) and, at each save and restore, the run's stateful parts by name (`StatefulParts`:
model, optimizer, scheduler, scaler, weight average, running metrics, spike detector, batch
stream, callbacks, strategy): it assembles and restores those and touches nothing else of the
Trainer. The whole training state is `assemble()` / `restore()` (`Trainer.state_dict()` /
`load_state_dict()` delegate to them; every rank takes part under torchrun). The loop checks
that the steps since the last check were good before it asks for a save (a checkpoint is always
a good state to resume or roll back to); the callbacks hear of each checkpoint. Every other
part lists and loads checkpoints through it (`list`, `newest`, `latest`, `load`), and a
rollback restores the newest clean one (`roll_back`).
"""

from __future__ import annotations

import builtins
import dataclasses
import logging
import math
import platform
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Protocol

import torch

from ..direction import inference_note, metric_mode
from ..errors import ConfigError, NonFiniteError, SaferunError
from ..data.seeding import get_rng_state
from ..data.transfer import move_to_device
from .. import distributed
from ..schedules import configured_hyperparameters, use_configured_hyperparameters
from ..version import __version__
from . import course, intent, rundir
from .compat import check_resume_config
from .formats import CheckpointFormat
from .store import (FORMAT_VERSION, LOCAL, CheckpointError, Storage, checkpoint_root, list_checkpoints,
                    load_checkpoint, load_latest, rotate, step_of)
from .superseded import FRESH, evaluated_weights, start_fresh
from .weights import Best, publish_weights

log = logging.getLogger("saferun")


class Owner(Protocol):
    """What the Checkpointer uses of the Trainer: its public state; the stateful parts come
    from the `parts` callable it is given."""

    cfg: Any
    state: Any  # LoopState: counters, metrics, validated_at, owed
    ranks: distributed.Ranks
    view: Any
    device: torch.device


@dataclasses.dataclass(frozen=True)
class StatefulParts:
    """The parts of a run whose state a checkpoint holds (and what a save coordinates with),
    named: the Checkpointer assembles and restores them and never reaches for them itself."""

    model: torch.nn.Module
    optimizer: Any  # an Optimizer, or several by name
    scheduler: Any  # an LRScheduler, several by name, or None
    scaler: Any  # GradScaler
    ema: Any  # trainer.ema's WeightAverage, or None
    running: Any  # RunningTrainMetrics: the log window not yet logged
    spikes: Any  # the spike detector (each rank's own; saved as a state per series), or None
    batches: Any  # BatchStream: the data position and the RNG states to restore
    callbacks: Any  # CallbackList
    strategy: Any  # the parallel strategy: gathers each rank's state, agrees on stops, and
    # names the checkpoint format that saves and loads the model and optimizer (formats.py)
    stop_signals: Any  # StopSignals: a save for a stop is completed before the exit


class Checkpointer:
    """Finds, resumes and saves the Trainer's checkpoints under <run_dir>/checkpoints."""

    def __init__(self, owner: Owner, parts: Callable[[], StatefulParts], storage: Storage = LOCAL) -> None:
        """`storage`: where the checkpoints are kept (every file operation on them goes
        through it; `store.LocalStorage` by default)."""
        self._owner = owner
        self._parts = parts  # the Trainer's parts as they are now (set up after this)
        self.storage = storage
        self.best: Optional[Best] = None  # save_best's best so far
        self.pending_resume: Optional[tuple[Path, dict[str, Any]]] = None  # found by setup
        self.untrained_auto = False  # resume=auto found nothing: the weights are the initial ones
        self.restored_best = False  # EarlyStopping(restore_best=True) put the best weights back
        t = owner.cfg.trainer
        self.best_mode = t.best_mode() if t.save_best else None  # min or max: given or inferred
        # an inferred direction is said once, at the first fit
        self._unsaid = t.save_best is not None and t.save_best_mode is None
        if t.run_dir is not None:  # resume=PATH: durable now, before the model is built
            intent.intend(t.run_dir, owner.cfg.resume, owner.ranks.is_main)
        self.carried_intent: Optional[str] = None  # resume=auto carrying out a killed run's intent

    def _format(self) -> CheckpointFormat:
        """How checkpoints hold the model and optimizer: the strategy's format."""
        return self._parts().strategy.checkpoint_format

    # ------------------------------------------------------------------ state

    def assemble(self) -> dict[str, Any]:
        """The Trainer's whole state (`Trainer.state_dict`); a collective under torchrun."""
        o, p = self._owner, self._parts()
        s = o.state
        epoch_start = p.batches.position_state()
        # Resumed but not trained yet (a finished run resumed): the loaded RNG states are the
        # run's, not the ones this process was seeded with.
        rng = p.batches.resume_rng if p.batches.resume_rng is not None else get_rng_state()
        p.running.catch_up()  # the steps' spike flags first: the detector's state includes them
        mine = move_to_device({"rng": rng, "running": p.running.state_dict(),
                               # the spike detector: each rank sees its own loss
                               "spikes": p.spikes.state_dict() if p.spikes is not None else {},
                               "epoch_start": epoch_start}, torch.device("cpu"))
        per_rank = p.strategy.gather(mine)
        return {
            "format": FORMAT_VERSION,
            "model": p.model.state_dict(),
            "optimizer": p.optimizer.state_dict(),
            "scheduler": p.scheduler.state_dict() if p.scheduler is not None else None,
            "scaler": p.scaler.state_dict(),
            # the same on every rank (sharded: each rank's shards, saved with the model's)
            "ema": p.ema.state_dict() if p.ema is not None else None,
            "loop": {**s.state_dict(),  # save_best's best as [value, checkpoint, step]
                     "best": [self.best.value, self.best.checkpoint, self.best.step] if self.best else None},
            "per_rank": per_rank,  # [{"rng", "running", "spikes", "epoch_start"}] per rank
            "layout": list(p.strategy.layout),  # (data ranks, ranks): whose shard per_rank holds
            "callbacks": p.callbacks.state_dict(),
            "config": dataclasses.asdict(o.cfg),
            "provenance": {"saferun": __version__, "torch": str(torch.__version__),
                           "python": platform.python_version(),
                           "threads": torch.get_num_threads()},  # (CPU sums round by them)
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """Put `assemble()`'s result back (`Trainer.load_state_dict`, after setup)."""
        o, p = self._owner, self._parts()
        self.replaced()  # this state replaces one found by setup
        formatted = p.strategy.checkpoint_format
        formatted.load(state, p.model, p.optimizer, p.ema)  # and trainer.ema's average
        if p.scheduler is not None and state["scheduler"] is not None:
            p.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:
            p.scaler.load_state_dict(state["scaler"])
        o.state.load_state_dict(state["loop"])
        _say_other_threads(state.get("provenance", {}).get("threads"), o.device)
        self.best = self._best_record(state["loop"]["best"]) if self._same_best(state) else None
        saved = tuple(state.get("layout") or (len(state["per_rank"]),) * 2)  # (before: data = ranks)
        if saved != tuple(p.strategy.layout) and formatted.reshards:
            self._resharded(saved)
            p.callbacks.load_state_dict(state["callbacks"], say_dropped=o.ranks.is_main)
            return
        if saved != tuple(p.strategy.layout):
            raise CheckpointError(
                f"the checkpoint was written by {saved[1]} process(es) and this run has "
                f"{o.ranks.world_size} (the data split {saved[0]} ways, now "
                f"{p.strategy.layout[0]}): each rank's RNG states and data shard would differ. "
                f"Resume with the same number of processes (and the same trainer.parallel).")
        mine = state["per_rank"][o.ranks.rank]
        p.running.load_state_dict(move_to_device(mine["running"], o.device))
        p.callbacks.load_state_dict(state["callbacks"], say_dropped=o.ranks.is_main)
        spikes = mine["spikes"]  # {"loss": state, "grad_norm": state}, or {} (saved without)
        if p.spikes is not None and spikes:
            for saved in spikes.values():
                _check_spike_window(saved, p.spikes.window)
            p.spikes.load_state_dict(move_to_device(spikes, o.device))
        p.batches.resume(mine["rng"], mine["epoch_start"])

    def _resharded(self, saved: tuple[int, ...]) -> None:
        """Another number of processes, or another split of the data over them (a device mesh
        of another shape): the model and optimizer were resharded exactly (DCP), the rest of
        the data order rule is said here."""
        o, p = self._owner, self._parts()
        p.batches.resume(None, None)  # this run's own RNG streams and data shards
        if o.ranks.is_main:
            log.warning(
                "Resumed a checkpoint written by %d process(es) with %d (the data split %d ways, "
                "now %d): the model and optimizer were resharded exactly, the step, epoch and "
                "position in it continue, but each rank's data shard and random streams differ "
                "from the uninterrupted run's, so it is not bitwise exact (it is with the same "
                "number of processes and the same trainer.parallel).",
                saved[1], o.ranks.world_size, saved[0], p.strategy.layout[0])

    # ------------------------------------------------------------------ resume

    def find_resume(self) -> None:
        """Find the checkpoint `cfg.resume` names (auto or a path) and load its weights, so that
        every entry point uses them; `fit` then restores the rest (`resume`). A refused
        resume=PATH drops its intent: nothing changed, resume=auto continues what is there."""
        try:
            self._find_resume()
        except SaferunError:
            self._drop_own_intent()
            raise

    def _drop_own_intent(self) -> None:
        o = self._owner
        if o.cfg.resume not in (None, FRESH, "auto"):
            intent.drop_intent(o.state.run_dir, o.ranks.is_main)

    def _find_resume(self) -> None:
        o = self._owner
        resume = o.cfg.resume
        if resume is None or resume == FRESH:
            return
        where = Path(o.state.run_dir) if resume == "auto" else Path(resume)
        unfinished = course.interrupted(o.state.run_dir) if resume == "auto" else None
        self.carried_intent = intent.intended(o.state.run_dir) \
            if resume == "auto" and unfinished is None else None
        if unfinished is not None:  # a change of course a killed run left: fit() finishes it
            where = Path(unfinished["resumed"])
            log.warning("resume=auto: %s holds a change of course to %s that a killed run left "
                        "unfinished; it is finished and the run continues from there.",
                        o.state.run_dir, where)
        elif self.carried_intent is not None:  # killed before it recorded the change: made now
            where = Path(self.carried_intent)
            log.warning("resume=auto: %s holds the intent of a change of course to %s (%s) that "
                        "a run killed before the change began left; the change is made now and "
                        "the run continues from there. To continue the course that is there "
                        "instead, delete that file.", o.state.run_dir, where, intent.INTENT)
        if self.storage.isfile(where / "manifest.json"):
            found: Optional[tuple[Path, dict[str, Any]]] = (where, self.load(where))
        else:
            root = where if where.name == "checkpoints" else checkpoint_root(where)
            found = load_latest(root, storage=self.storage)
        if found is None and self.carried_intent is not None:
            raise CheckpointError(
                f"resume=auto: {o.state.run_dir} holds the intent of a change of course to "
                f"{where} ({intent.INTENT}, left by a run killed before the change began), but "
                f"{no_checkpoint_at(str(where), self.storage)} Delete {intent.INTENT} to continue the course "
                f"that is there, or set resume=PATH to the checkpoint you meant.")
        if found is None:
            if resume != "auto":
                raise CheckpointError(no_checkpoint_at(resume, self.storage))
            log.info("resume=auto: no checkpoint in %s yet; starting fresh.", where)
            self.untrained_auto = True
            return
        state = found[1]
        # Evaluation needs only the same model; continuing training needs the whole config.
        check_resume_config(state["config"], dataclasses.asdict(o.cfg), o.cfg.force_resume,
                            keys=("model", "task"), purpose="use the checkpoint's weights")
        self.load_weights(*found)
        o.state.load_counters(state["loop"])
        self.best = self._best_record(state["loop"]["best"])  # Trainer.best, before any fit
        self.pending_resume = found

    def begin_run(self, save: Callable[[], Path]) -> None:
        """Check and lock the run directory (one writer at a time), start fresh or resume, and
        only then, with the run accepted, record its config in <run_dir>/config.yaml. `save`:
        the loop's checked save (a change of course saves this directory's first checkpoint)."""
        o = self._owner
        intent.kill_point("course-built")  # the model built, the checkpoint read, nothing recorded
        self._run_dir_lock = rundir.claim(o.state.run_dir, o.ranks.is_main)
        try:
            unfinished = course.interrupted(o.state.run_dir)
            found = self.pending_resume
            if unfinished is not None and (found is None or str(found[0].resolve()) != unfinished["resumed"]):
                course.refuse_other_start(o.state.run_dir, o.cfg.resume, unfinished)
            if self.pending_resume is None and o.state.step == 0:
                callbacks = self._parts().callbacks  # an earlier run's files, theirs too: aside
                aside = start_fresh(o.state.run_dir, o.cfg.resume, o.ranks.is_main, callbacks.owned_run_files())
                callbacks.on_fresh_start(o.view, aside)
                intent.drop_intent(o.state.run_dir, o.ranks.is_main)  # this start replaces it
            self.resume(save)
            if o.ranks.is_main:
                rundir.write_config(o.state.run_dir, dataclasses.asdict(o.cfg))
            if self._unsaid and o.ranks.is_main:  # now: a refused start says nothing there
                log.info(inference_note(o.cfg.trainer.save_best or "", "trainer.save_best",
                                        "trainer.save_best_mode={mode}"))
            self._unsaid = False
        except BaseException as e:
            self._run_dir_lock.release()
            if isinstance(e, SaferunError):  # refused: its intent too (a kill leaves it)
                self._drop_own_intent()
            raise

    def end_run(self) -> None:
        """fit() ended, normally or not: release the run directory."""
        self._run_dir_lock.release()

    def resume(self, save: Callable[[], Path]) -> None:
        """Continue training from the checkpoint found by setup, after checking the config;
        `save`: as `begin_run`'s."""
        o, p = self._owner, self._parts()
        found, self.pending_resume = self.pending_resume, None
        self.untrained_auto = False  # fit trains them
        if found is None:
            return
        path, state = found
        config = dataclasses.asdict(o.cfg)
        check_resume_config(state["config"], config, o.cfg.force_resume)
        forced = [k for k in ("optim", "sched") if state["config"].get(k) != config[k]]
        configured = configured_hyperparameters(p.optimizer, p.scheduler) if forced else None
        self.restore(state)  # in memory (it may refuse): the files are untouched so far
        # resume=PATH, or auto finishing a killed one's change: what PATH supersedes goes aside
        # (auto alone took the newest checkpoint: nothing is newer)
        changed = course.change_course(o.state.run_dir, path, state["loop"]["step"], o.ranks.is_main,
                                       p.callbacks.owned_run_files()) \
            if o.cfg.resume != "auto" or course.interrupted(o.state.run_dir) or self.carried_intent \
            else None
        if changed is not None:  # (before ensure_one: its checkpoint holds what they make of it)
            p.callbacks.on_course_change(o.view, str(Path(o.state.run_dir) / changed["aside"]),
                                         changed["resumed"], changed["step"])
        log.info("Resumed from %s: step %d, epoch %d, batch %d of the epoch.", path,
                 o.state.step, o.state.epoch, o.state.batches_in_epoch)
        if configured is not None:  # force_resume with a new optim/sched: what was asked applies
            use_configured_hyperparameters(p.optimizer, p.scheduler, configured,
                                           state["scheduler"], o.state.step)
            log.warning("force_resume: %s changed; the optimizer now uses the configured values "
                        "(learning rate %s at step %d), its moments are the checkpoint's.",
                        ", ".join(forced), p.optimizer.param_groups[0]["lr"], o.state.step)
        if changed is not None:
            self._best_of_this_directory(path)
        if self.best is not None and self.best.step == o.state.step:
            # resumed at the best's step (a crash may have come between its checkpoint and
            # model_best.pt): the weights now are the best's, so model_best.pt is written again
            self.write_weights("_best")
        if changed is not None:
            # PATH elsewhere: this run directory's own first checkpoint, as this run goes on
            # (after force_resume's values: a resume from it must not go back to PATH's)
            self.ensure_one(save)
            course.finished(o.state.run_dir, changed, o.ranks.is_main)
            if o.ranks.is_main:
                log.warning("resume=%s: the course it supersedes in this run directory (%s) is "
                            "moved to %s, nothing deleted; this run's logs hold the course of "
                            "%s up to step %d, then this run.", o.cfg.resume,
                            ", ".join(changed["move"]) or "nothing", Path(o.state.run_dir) / changed["aside"],
                            path, o.state.step)

    def _best_of_this_directory(self, resumed: Path) -> None:
        """After a change of course, save_best's record names a checkpoint of this run
        directory: PATH itself (elsewhere: this directory's copy of it, saved next), one kept
        here, or none ("") when the superseded course's rotation deleted it or it lies in
        another run directory. Its value stays: a new best must beat the course's best so far."""
        if self.best is None:
            return
        named = self.best.checkpoint
        root = checkpoint_root(self._owner.state.run_dir)
        if Path(named).resolve() == resumed.resolve():
            self.best = dataclasses.replace(self.best, checkpoint=str(root / resumed.name))
        elif Path(named).parent.resolve() != root.resolve() or not self.storage.isdir(Path(named)):
            self.best = dataclasses.replace(self.best, checkpoint="")
            if self._owner.ranks.is_main:
                log.warning("save_best: the best checkpoint of this course so far (%s %s, %s) is "
                            "not in this run directory (deleted by the superseded course's "
                            "rotation, or in another run directory); a later checkpoint becomes "
                            "the best only if it beats that value.", self._owner.cfg.trainer.save_best,
                            self.best.value, named)

    def replaced(self) -> None:
        """`load_state_dict` was called: its state replaces any found by setup."""
        self.pending_resume, self.untrained_auto = None, False

    def _same_best(self, state: Mapping[str, Any]) -> bool:
        """Does the checkpoint's best record measure what this run's save_best does? A resume
        that changed trainer.save_best (or its mode) starts the best anew, saying so: the old
        value would be compared with another metric, and model_best.pt kept for it. A mode
        this run infers from the name but the checkpoint's run gave otherwise is refused: that
        change would be silent (the setting left off the resumed command)."""
        t, saved = self._owner.cfg.trainer, state["config"]["trainer"]
        if state["loop"]["best"] is None:
            return True
        before = (saved.get("save_best"), saved_best_mode(saved))
        if before == (t.save_best, self.best_mode):
            return True
        if before[0] == t.save_best and t.save_best_mode is None:
            raise ConfigError(
                f"trainer.save_best={t.save_best}: the checkpoint's best was kept with "
                f"trainer.save_best_mode={before[1]}, and this run infers {self.best_mode} from "
                f"the name. Set trainer.save_best_mode={before[1]} to continue that best, or "
                f"trainer.save_best_mode={self.best_mode} to track the best anew "
                f"(model_best.pt is then replaced at the next validation that sets one).")
        log.warning("trainer.save_best changed on resume (%s %s -> %s %s): the best is tracked "
                    "anew from here; model_best.pt is replaced at the next validation that sets "
                    "one.", *before, t.save_best, self.best_mode)
        return False

    def check_evaluated_weights(self, entry: str) -> None:
        o = self._owner
        self._drop_own_intent()  # an evaluation changes no course
        evaluated_weights(entry, o.state.run_dir, o.cfg.resume, self.untrained_auto,
                          self.pending_resume is None and o.state.step == 0 and o.ranks.is_main)

    def load_weights(self, path: Path, state: Mapping[str, Any]) -> None:
        """The model's weights (and trainer.ema's average) from checkpoint `path` (`state`):
        what evaluation needs of a resume, and what EarlyStopping(restore_best=True) restores."""
        p = self._parts()
        # validate() reports val_ema/ too: the checkpoint's average
        p.strategy.checkpoint_format.load_model(path, state, p.model, p.ema)

    # ------------------------------------------------------------------ save

    def path(self) -> Path:
        """The checkpoint directory a save now writes (step-N of this step)."""
        o = self._owner
        return checkpoint_root(o.state.run_dir) / f"step-{o.state.step:08d}"

    def save(self, best: Optional[float] = None) -> Path:
        """Save the state; `best`: this is save_best's new best checkpoint, with that value.
        The loop calls it once the steps since the last check and the state it would write are
        known good (a checkpoint is always a good state to resume or roll back to)."""
        o, p = self._owner, self._parts()
        t = o.cfg.trainer
        root, path = checkpoint_root(o.state.run_dir), self.path()
        if best is not None:  # before assemble(): the checkpoint records itself as the best
            self.best = self._best(best, str(path), o.state.step)
        state = self.assemble()  # under torchrun, a collective: every rank calls it
        rotation = lambda done: rotate(root, t.keep_last,  # noqa: E731
                                       keep=[Path(self.best.checkpoint)] if self.best else (), current=done,
                                       storage=self.storage)
        formatted = p.strategy.checkpoint_format  # rank 0 writes state.pt; sharded: every rank its shards
        formatted.save(root, o.state.step, state, p.model, p.optimizer, rotation, self.storage)
        if p.strategy.agreement.stop_agreed(p.stop_signals):  # the ranks exit after this save
            formatted.finish()  # (perhaps written in the background)
        distributed.barrier()  # no rank goes on (or exits) before the checkpoint is complete
        p.callbacks.on_checkpoint(o.view, str(path))
        return path

    def save_final(self, step: int, restore_best: bool = False) -> None:
        """After the loop's last save (of the final state, at `step`): that checkpoint complete
        and model.pt; with `restore_best` (an EarlyStopping(restore_best=True) among the
        callbacks), then the best weights back."""
        if self._owner.state.step != step:  # not finite, nothing saved: rolled back
            raise NonFiniteError(
                f"the run's final state (step {step}) was not finite, so neither its checkpoint "
                f"nor model.pt was written; guards.nonfinite=rollback went back to step "
                f"{self._owner.state.step}, and the run ended there. To train the remaining "
                f"steps, continue with resume=auto (or call fit() again on this Trainer).")
        self._format().finish()  # the run's last checkpoint is complete before it ends
        self.write_weights("")
        if restore_best:
            self.restore_best()  # after model.pt: the files keep the final weights
            self.restored_best = True

    def write_weights(self, suffix: str) -> None:
        """<run_dir>/model{suffix}.pt (and model_ema{suffix}.pt with trainer.ema), atomically:
        the model's whole weights, loadable without saferun; model.pt at the end, model_best.pt
        at each new best. Every rank calls it (fsdp gathers the shards); rank 0 writes."""
        o, p = self._owner, self._parts()
        weights = p.strategy.checkpoint_format.export(p.model)  # sharded: gathered from every rank
        averaged = p.ema.export() if p.ema is not None else None  # (the same)
        if o.ranks.is_main:  # whole and unsharded: loadable without saferun
            files = {f"model{suffix}.pt": weights}
            if averaged is not None:  # loads into the same model class as model.pt
                files[f"model_ema{suffix}.pt"] = averaged
            record: dict[str, Any] = {"step": o.state.step, "epoch": o.state.epoch}
            best = self.best_record() if suffix == "_best" else None
            if best is not None:  # its record and summary.json's "best": metric, value, step
                record.update(metric=best.metric, value=best.value)
            # each file with its digest in summary.json, crash-consistently with "best"
            publish_weights(o.state.run_dir, files, record,
                            {"best": dataclasses.asdict(best)} if best is not None else {})

    def best_record(self) -> Optional[Best]:
        """save_best's best so far, or None (no save_best, or no finite value yet)."""
        return self.best

    def _best(self, value: float, checkpoint: str, step: int) -> Best:
        """save_best's record of a best `value` at `step`, kept in `checkpoint`."""
        o = self._owner
        return Best(o.cfg.trainer.save_best, value, step,  # type: ignore[arg-type]  # (None: a run evaluated without save_best)
                    str(Path(o.state.run_dir) / "model_best.pt"), checkpoint)

    def _best_record(self, saved: Any) -> Optional[Best]:
        """A checkpoint's save_best record, [value, checkpoint, step], or None."""
        return self._best(saved[0], saved[1], int(saved[2])) if saved else None

    def restore_best(self) -> None:
        """EarlyStopping(restore_best=True), at the end of fit: the model (and trainer.ema's
        average) get the best checkpoint's weights; the optimizer, schedule and step stay the
        final ones, and the files (checkpoints, model.pt, model_best.pt) stay as they are."""
        o = self._owner
        if self.best is None or not self.best.checkpoint:
            if o.ranks.is_main:
                log.warning("EarlyStopping(restore_best=True): no best checkpoint %s, so the "
                            "model keeps its final weights.", "in this run directory"
                            if self.best else "(no validation reported a finite value)")
            return
        path = Path(self.best.checkpoint)
        self.load_weights(path, self.load(path))
        if o.ranks.is_main:
            log.info("EarlyStopping(restore_best=True): the model holds the best weights (%s %s "
                     "at step %d) again.", o.cfg.trainer.save_best, self.best.value, self.best.step)

    def ensure_one(self, save: Callable[[], Path]) -> None:
        """Save now (the loop's checked `save`) if the run has no checkpoint yet (rollback and
        anomaly replay need one)."""
        if not self.list():
            save()
            self._format().finish()  # complete now, not at the next log point

    def new_best(self, metrics: Mapping[str, float]) -> Optional[float]:
        """trainer.save_best: the watched metric's value when validation improved it (the loop
        then saves with it, and calls `best_saved`), else None."""
        key = self._owner.cfg.trainer.save_best
        return metrics[key] if key is not None and self._improves(metrics, key) else None

    def best_saved(self, path: Path) -> None:
        """The loop's save of a new best returned `path`: model_best.pt follows it (not when
        the save rolled back instead)."""
        if self.best is not None and self.best.checkpoint == str(path):
            self.write_weights("_best")

    def _improves(self, metrics: Mapping[str, float], key: str) -> bool:
        if key not in metrics:
            raise ConfigError(f"trainer.save_best={key!r}, but validation reports only "
                              f"{', '.join(metrics)}.")
        value = metrics[key]
        if math.isnan(value):  # never the best; and a NaN best is beaten by any number
            return False
        if self.best is None or math.isnan(self.best.value):
            return True
        return value < self.best.value if self.best_mode == "min" else value > self.best.value

    # ------------------------------------------------------------------ the run's checkpoints

    def list(self) -> list[Path]:
        """This run directory's checkpoints, oldest first (complete-looking, not verified)."""
        return list_checkpoints(checkpoint_root(self._owner.state.run_dir), self.storage)

    def newest(self) -> Optional[tuple[Path, int]]:
        """The newest checkpoint (not verified) and its step, or None."""
        found = self.list()
        return (found[-1], step_of(found[-1])) if found else None

    def load(self, path: Path) -> dict[str, Any]:
        """Checkpoint `path`'s state, verified (`CheckpointError` if it does not)."""
        return load_checkpoint(path, storage=self.storage)

    def latest(self) -> Optional[tuple[Path, dict[str, Any]]]:
        """The newest checkpoint that verifies, with its state, or None (see `store.load_latest`)."""
        return load_latest(checkpoint_root(self._owner.state.run_dir), storage=self.storage)

    def roll_back(self, unclean: Callable[[], Optional[str]]) -> tuple[Optional[Path], builtins.list[str]]:
        """Restore the newest checkpoint that verifies and that `unclean()` (asked once it is
        restored) finds nothing wrong with, and go on with the data after the current position
        (a bad step replayed would fail the same way): (its path, or None when none is clean;
        why each newer one was passed over)."""
        o, p = self._owner, self._parts()
        epoch, position = o.state.epoch, o.state.batches_in_epoch
        skipped: builtins.list[str] = []
        for path in reversed(self.list()):  # newest first
            try:
                state = self.load(path)
            except CheckpointError as e:
                skipped.append(f"{path.name} (damaged: {e})")
                continue
            self.restore(state)
            bad = unclean()
            if bad is None:
                o.state.epoch, o.state.batches_in_epoch = epoch, position
                p.batches.resume(None, None)
                p.running.reset()
                return path, skipped
            skipped.append(f"{path.name} (not finite: {bad})")
        return None, skipped


def _check_spike_window(saved: Mapping[str, Any], window: int) -> None:
    """The spike statistics of a checkpoint are of its guards.spike_window steps: they cannot be
    resized, not even under force_resume."""
    steps = saved["values"].numel()
    if steps != window:
        raise ConfigError(
            f"cannot resume with guards.spike_window={window}: the checkpoint's spike statistics "
            f"are of the last {steps} steps and cannot be resized (not even with force_resume). "
            f"Resume with guards.spike_window={steps}.")


# what users of other tools write for "the newest checkpoint"
_AUTO_WORDS = {"latest", "last", "newest", "true", "yes", "on", "1", "continue", "resume"}
ACCEPTS = ("resume accepts auto (the newest checkpoint of this run directory), fresh (start "
           "over here, the earlier run moved aside), a run directory (its newest checkpoint) or "
           "a checkpoint directory (<run dir>/checkpoints/step-N)")


def no_checkpoint_at(resume: str, storage: Storage = LOCAL) -> str:
    """Why `resume=PATH` found no complete checkpoint: what is at PATH, what resume accepts."""
    where = Path(resume)
    if storage.isfile(where):
        what = f"{where} is a file, not a run directory or checkpoint directory"
    elif not storage.isdir(where):
        what = f"{where.absolute()} does not exist"
        if resume.lower() in _AUTO_WORDS:
            what += "; did you mean resume=auto (the newest checkpoint of this run directory)?"
    else:
        runs = sorted((where / name for name in storage.listdir(where)
                       if list_checkpoints(checkpoint_root(where / name), storage)),
                      key=lambda p: storage.modified(list_checkpoints(checkpoint_root(p), storage)[-1]))
        what = f"{where} exists but holds no complete checkpoint"
        if runs:
            what += (f"; it holds run directories ({', '.join(p.name for p in runs[-5:])}): "
                     f"name one, e.g. the latest, resume={runs[-1]}")
    return f"resume={resume}: {what}{'' if what.endswith('?') else '.'} {ACCEPTS}."


def saved_best_mode(trainer: Mapping[str, Any]) -> Optional[str]:
    """The direction of save_best in a checkpoint's trainer config: given, or inferred then (a
    config of this version without save_best_mode); None without save_best."""
    if not trainer.get("save_best"):
        return None
    return metric_mode(trainer["save_best"], trainer.get("save_best_mode"), "trainer.save_best",
                       "trainer.save_best_mode={mode}")


def _say_other_threads(saved: Optional[int], device: torch.device) -> None:
    """A resume on the CPU with another number of compute threads than the checkpoint's run
    continues the same run, but its float sums split differently and round differently: say
    so, and how to get the bit-for-bit resume (trainer.num_threads=auto plans the threads from
    the cores free when a run starts, which another load at the resume changes)."""
    threads = torch.get_num_threads()
    if saved is None or saved == threads or device.type != "cpu":
        return
    log.warning("Resumed with %d compute threads; the checkpoint's run used %d "
                "(trainer.num_threads=auto plans them from the cores free at start-up). The run "
                "continues, but its CPU sums may round differently from an uninterrupted run's: "
                "for a bit-for-bit resume, set trainer.num_threads=%d.", threads, saved, saved)
