"""Callbacks: typed events that observe the loop and may ask it to stop or evaluate.

The loop, with the events marked where they fire (tests/test_event_order.py
pins this order)::

    setup()                  seed; build model, datasets, loaders, optimizer, scheduler
    from step 0: an earlier run's files (with each callback's run_files) set aside;
                 on_fresh_start(view, aside)
    resume                   if cfg.resume: load the checkpoint (load_state_dict), replay
                             the data position
    resume=PATH: the superseded course (with each callback's run_files) set aside;
                 on_course_change(view, aside, resumed, step)
    on_fit_start(view)
    if the checkpoint was saved by a stop during a validation: finish that step first
                             (validate, on_validation_end, save_best, a due save, a stop)
    while step < max_steps (and epoch < max_epochs):
        for each group of `accumulate` micro-batches of the epoch:
            train_step()     forward, backward, clip, optimizer step, zero_grad, LR step
            step += 1
            on_train_step_end(view, output)              -> Control | None
            if step % log_every_n_steps == 0:
                on_log(view, metrics)                    -> Control | None
                on_media(view, media)    what training_step logged with log_image/_histogram/_text
            if validation is due or a callback asked for it:
                validate()   validation_step over the set, then on_evaluate(view, model, log)
                             in eval mode under the purity check; step a ReduceLROnPlateau
                on_validation_end(view, metrics) -> Control | None
                on_media(view, media)    what validation logged with log_image/_histogram/_text
                if save_best improved: save; on_checkpoint(view, path)
            if a save is due or a callback asked for it:
                save; on_checkpoint(view, path)
            if SIGTERM/SIGINT arrived: save; on_checkpoint; on_exception(view, Preempted)
                             (also between validation batches: the validation is then owed)
            if a callback asked to stop or step == max_steps: leave
        end of epoch: validation is due here when val_every_n_steps is null
    on_log(view, metrics)    for the steps since the last log point, if any
    validate(); on_validation_end(view, metrics)   unless the last step just validated
    save (unless this step was just saved); on_checkpoint(view, path); write model.pt
    on_fit_end(view, metrics)
    on_exception(view, exc)  instead, if anything above raised; the exception propagates

    test(data)               outside fit: test_step over the test set as validate() runs
                             validation_step (eval mode, inference_mode, purity checked)
    on_test_end(view, metrics)   its test/... metrics

A callback sees a read-only `TrainerView`, never the model or the optimizer,
and its only lever is the `Control` it returns. Callbacks run in list order.
The one exception is `on_evaluate`, for callbacks that need the model (sample images from a
generator, a probe on a fixed batch): it runs inside validation, on the ranks the callback's
`evaluate_ranks` names ("main", the default, or "all"), with the model in eval mode under
inference_mode (trainer.eval_grad_mode), training's random streams untouched, and the
purity guard checking that it left every parameter and buffer as it found them
(guards.eval_purity). What it logs through `log` is reported with the validation.

Under torchrun every rank runs its callbacks (loggers exist on rank 0 only), and a
`Control` returned on any rank counts for all, so that every rank stops, validates and
saves at the same step. One returned from `on_log` or `on_validation_end` acts at once, as
in a single process (the ranks exchange three flags there); one returned from
`on_train_step_end` acts at the next log point (`log_every_n_steps`) or validation,
whichever comes first, since agreeing at every step would cost a collective per step.
In a single process every request acts at once.
`on_train_step_end` receives device tensors: reading their values (`.item()`,
`float()`, `if t:`) forces a host sync every step; use `on_log`, whose
metrics are already Python floats.

The lifecycle of a run directory, for a callback with state of its own (a tracker's run, a
file it writes): `state_dict`/`load_state_dict` carry what travels with a checkpoint; the
entries of the run directory it names in `run_files` belong to the course that wrote them and
move aside with it, as the checkpoints and logs do, on a fresh start (`on_fresh_start`) and a
change of course (`on_course_change`), which tell it where they went. So a tracker keeps its
run id in a file of the run directory (a run belongs to a run directory, never to a checkpoint
that travels): a resume=auto finds it and continues that run; a fresh start or a change of
course finds none and starts a new run (linked to the checkpoint's, for a course).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping, Optional, Protocol, Sequence, runtime_checkable

import torch

from .errors import SaferunError

log = logging.getLogger("saferun")

if TYPE_CHECKING:
    from .state import LoopState


@dataclass(frozen=True)
class Control:
    """What a callback asks of the loop. The loop ORs the requests of all callbacks (under
    torchrun, of every rank: see the module docstring for when a request then acts)."""

    stop: bool = False
    """Stop training after this step (final validation and on_fit_end still run)."""
    evaluate: bool = False
    """Run validation after this step."""
    save: bool = False
    """Write a checkpoint after this step."""

    def __or__(self, other: Optional["Control"]) -> "Control":
        if other is None:
            return self
        return Control(stop=self.stop or other.stop, evaluate=self.evaluate or other.evaluate,
                       save=self.save or other.save)


@dataclass(frozen=True)
class StepOutput:
    """What one optimizer step produced. The tensors stay on the device."""

    loss: torch.Tensor
    """Mean loss over the step's micro-batches (detached)."""
    grad_norm: torch.Tensor
    """Total gradient norm before clipping."""
    logs: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """Extra scalars returned by training_step (detached)."""
    num_samples: int = 0
    """Samples in the step's micro-batches."""
    skipped: bool = False
    """The update was dropped (a guard's skip policy): the step was non-finite or a spike."""
    spike: Optional[torch.Tensor] = None
    """With guards.spikes on and a skip policy (guards.spikes or guards.nonfinite =skip): 0-dim
    bool device tensor, True if the loss or grad norm spiked. None otherwise: the raise and
    rollback policies compare a log interval's steps at its log point (and before a save), all
    at once, and report the first spike there (train/spikes counts them)."""
    loss_spike: Optional[torch.Tensor] = None
    """Set with `spike`: True if this process's own loss spiked. Under torchrun the gradient
    norm is the same on every rank, so this says on which rank a spike started."""


@dataclass
class Media:
    """An image, histogram or text to write at the next log point or validation end."""

    kind: str  # "image" | "histogram" | "text"
    name: str  # with its prefix: train/..., val/...
    value: Any  # a detached tensor (CPU once read) or a str
    step: int = 0  # set when written: the step of that log point or validation

    def at(self, step: int) -> "Media":
        """This media to write at `step`, its tensor on the CPU (the one host read)."""
        value = self.value.cpu() if isinstance(self.value, torch.Tensor) else self.value
        return Media(self.kind, self.name, value, step)


class TrainerView:
    """Read-only view of the loop's state, handed to callbacks."""

    __slots__ = ("_state",)

    def __init__(self, state: "LoopState") -> None:
        self._state = state

    @property
    def step(self) -> int:
        """Optimizer steps taken so far."""
        return self._state.step

    @property
    def epoch(self) -> int:
        """Current epoch (0-based)."""
        return self._state.epoch

    @property
    def max_steps(self) -> Optional[int]:
        """The run's length in steps; None while it is not known (epochs of a stream)."""
        return self._state.max_steps

    @property
    def samples_seen(self) -> int:
        return self._state.samples_seen

    @property
    def run_dir(self) -> str:
        return self._state.run_dir

    @property
    def metrics(self) -> Mapping[str, float]:
        """The latest value of every logged metric (host floats)."""
        return MappingProxyType(self._state.metrics)

    @property
    def config(self) -> Mapping[str, Any]:
        """The resolved run config as plain data."""
        return MappingProxyType(self._state.config)

    @property
    def rank(self) -> int:
        return self._state.rank

    @property
    def world_size(self) -> int:
        return self._state.world_size


@runtime_checkable
class Callback(Protocol):
    """The events a callback may implement. Subclass it to inherit no-op defaults."""

    run_files: Sequence[str] = ()
    """Entries of the run directory this callback owns (names, e.g. "wandb"): they move aside
    with the course that wrote them (a fresh start, a change of course)."""

    state_key: Optional[str] = None
    """What tells this callback's saved state from that of others of its class, when its state
    belongs to its configuration (EarlyStopping: "monitor='val/loss'"). A resume gives each
    callback the state saved under its class, this key and its place among those."""

    def on_fresh_start(self, view: TrainerView, aside: Optional[str]) -> None:
        """fit() starts from step 0 (no checkpoint resumed); an earlier run's files, this
        callback's `run_files` among them, were moved into the folder `aside` (None: there were
        none). Before on_fit_start."""
        return None

    def on_course_change(self, view: TrainerView, aside: str, resumed: str, step: int) -> None:
        """resume=PATH changed course: the run continues from checkpoint `resumed` (step
        `step`, its state loaded), and the course it supersedes in this run directory, this
        callback's `run_files` among it, was moved into the folder `aside`. A branch into
        another run directory is one too. Before on_fit_start."""
        return None

    def on_fit_start(self, view: TrainerView) -> None:
        """Training is about to start; everything is built."""
        return None

    def on_train_step_end(self, view: TrainerView, output: StepOutput) -> Optional[Control]:
        """An optimizer step finished. `output` holds device tensors: reading them syncs."""
        return None

    def on_log(self, view: TrainerView, metrics: Mapping[str, float]) -> Optional[Control]:
        """Metrics averaged since the last log point, as host floats."""
        return None

    def on_validation_end(self, view: TrainerView, metrics: Mapping[str, float]) -> Optional[Control]:
        """Validation finished; `metrics` are averages weighted by batch size."""
        return None

    def on_evaluate(self, view: TrainerView, model: torch.nn.Module, log: Any) -> None:
        """During validation, after validation_step: run code on `model` (eval mode, no
        autograd, checked by the purity guard). `log` has the Trainer's log, log_image,
        log_histogram and log_text; what it logs is val/<name> at this step. Runs on rank 0
        unless the callback sets `evaluate_ranks = "all"`."""
        return None

    def on_media(self, view: TrainerView, media: Sequence[Any]) -> None:
        """Images, histograms and texts (`saferun.callbacks.Media`: kind, name, value on the
        CPU, step) logged since the last log point or in this validation; rank 0 only."""
        return None

    def on_checkpoint(self, view: TrainerView, path: str) -> None:
        """A complete checkpoint was written to the directory `path`."""
        return None

    def on_fit_end(self, view: TrainerView, metrics: Mapping[str, float]) -> None:
        """Training finished normally; `metrics` are the final metrics."""
        return None

    def on_test_end(self, view: TrainerView, metrics: Mapping[str, float]) -> None:
        """`Trainer.test()` finished; `metrics` are its test/... averages (on every rank; the
        loggers, on rank 0, write them at the trainer's step)."""
        return None

    def on_exception(self, view: TrainerView, exc: BaseException) -> None:
        """Training stopped with `exc`, which propagates after all callbacks ran."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """State to save in a checkpoint."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        return None


class CallbackList(Callback):
    """Calls each callback in list order and ORs the Controls they return."""

    def __init__(self, callbacks: Sequence[Callback]) -> None:
        self.callbacks = list(callbacks)
        # The per-step event goes only to the callbacks that implement it (the inherited no-op
        # would cost a call per callback and step). The list is fixed here, as `callbacks` is.
        self._on_step_end = [cb for cb in self.callbacks if _implements(cb, "on_train_step_end")]
        for cb in self.callbacks:  # (at setup: before anything is moved aside)
            owned = getattr(cb, "run_files", ())
            if isinstance(owned, str) or not all(
                    isinstance(n, str) and n not in ("", ".", "..") and "/" not in n for n in owned):
                raise SaferunError(f"{type(cb).__name__}.run_files is {owned!r}: it names entries "
                                   f"of the run directory, a tuple of plain names (files or "
                                   f"folders, no '/'), e.g. (\"wandb\",).")

    def owned_run_files(self) -> list[str]:
        """Every callback's `run_files`."""
        return [name for cb in self.callbacks for name in getattr(cb, "run_files", ())]

    def on_fresh_start(self, view: TrainerView, aside: Optional[str]) -> None:
        for cb in self.callbacks:
            if getattr(cb, "on_fresh_start", None) is not None:  # (a callback not subclassing Callback)
                cb.on_fresh_start(view, aside)

    def on_course_change(self, view: TrainerView, aside: str, resumed: str, step: int) -> None:
        for cb in self.callbacks:
            if getattr(cb, "on_course_change", None) is not None:
                cb.on_course_change(view, aside, resumed, step)

    def on_fit_start(self, view: TrainerView) -> None:
        for cb in self.callbacks:
            cb.on_fit_start(view)

    def on_train_step_end(self, view: TrainerView, output: StepOutput) -> Optional[Control]:
        control = None
        for cb in self._on_step_end:
            asked = cb.on_train_step_end(view, output)
            if asked is not None:
                control = asked if control is None else control | asked
        return control

    def on_log(self, view: TrainerView, metrics: Mapping[str, float]) -> Optional[Control]:
        control = None
        for cb in self.callbacks:
            control = _merge(control, cb.on_log(view, metrics))
        return control

    def on_validation_end(self, view: TrainerView, metrics: Mapping[str, float]) -> Optional[Control]:
        control = None
        for cb in self.callbacks:
            control = _merge(control, cb.on_validation_end(view, metrics))
        return control

    def on_evaluate(self, view: TrainerView, model: torch.nn.Module, log: Any,
                    is_main: bool = True, sharded: bool = False) -> None:
        for cb in self.callbacks:
            if getattr(type(cb), "on_evaluate", None) in (None, Callback.on_evaluate):
                continue  # not overridden: nothing to run (a sharded run must not refuse it)
            ranks = getattr(cb, "evaluate_ranks", "main")
            if ranks not in ("main", "all"):
                raise SaferunError(f"{type(cb).__name__}.evaluate_ranks is {ranks!r}: "
                                   f"\"main\" (rank 0) or \"all\".")
            if sharded and ranks != "all":  # every rank must take part in a sharded forward
                raise SaferunError(f"{type(cb).__name__}.on_evaluate runs on rank 0 only, but "
                                   f"with trainer.strategy=fsdp the model's forward needs every "
                                   f"rank: set evaluate_ranks = \"all\".")
            if ranks == "all" or is_main:
                cb.on_evaluate(view, model, log)

    def on_media(self, view: TrainerView, media: Sequence[Any]) -> None:
        for cb in self.callbacks:
            if getattr(cb, "on_media", None) is not None:
                cb.on_media(view, media)

    def on_checkpoint(self, view: TrainerView, path: str) -> None:
        for cb in self.callbacks:
            cb.on_checkpoint(view, path)

    def on_test_end(self, view: TrainerView, metrics: Mapping[str, float]) -> None:
        for cb in self.callbacks:
            if getattr(cb, "on_test_end", None) is not None:  # (a callback not subclassing Callback)
                cb.on_test_end(view, metrics)

    def on_fit_end(self, view: TrainerView, metrics: Mapping[str, float]) -> None:
        for cb in self.callbacks:
            cb.on_fit_end(view, metrics)

    def on_exception(self, view: TrainerView, exc: BaseException) -> None:
        for cb in self.callbacks:
            cb.on_exception(view, exc)

    def state_dict(self) -> dict[str, Any]:
        """Each callback's state, keyed "n:ClassName(state_key)" (the n-th callback of that
        class and state_key), so that a resume with a callback added, removed or moved elsewhere
        in the list gives each its own."""
        return {key: cb.state_dict() for key, cb in zip(_keys(self.callbacks), self.callbacks)}

    def load_state_dict(self, state: Mapping[str, Any], say_dropped: bool = True) -> None:
        """Give each callback the state saved for its class, its `state_key` and its place among
        those; a saved state no callback of this run takes is said (it is dropped), unless not
        `say_dropped` (under torchrun the other ranks: the loggers are rank 0's alone)."""
        saved = _by_class(state)  # (also reads earlier checkpoints: keyed by the index in the list)
        taken = set()
        for key, bare, cb in zip(_keys(self.callbacks), _keys(self.callbacks, bare=True),
                                 self.callbacks):
            # (a checkpoint from before state_key: the class and place among the class)
            key = key if key in saved else bare
            if key in saved and key not in taken:
                taken.add(key)
                cb.load_state_dict(saved[key])
        dropped = sorted(k.split(":", 1)[1] for k, v in saved.items() if k not in taken and v)
        if dropped and say_dropped:
            log.warning("The checkpoint holds the state of callbacks this run does not have (%s): "
                        "it is dropped. Resume with the same callbacks to continue them.",
                        ", ".join(dropped))


def _implements(cb: Any, event: str) -> bool:
    """Does `cb` do anything on `event`: not Callback's inherited no-op (a callback that does
    not subclass Callback, or sets the method on the instance, always counts)."""
    method = getattr(cb, event, None)  # (missing: the call fails as it always did)
    return getattr(method, "__func__", None) is not getattr(Callback, event)


def _merge(a: Optional[Control], b: Optional[Control]) -> Optional[Control]:
    if a is None:
        return b
    return a | b


def _keys(callbacks: Sequence[Any], bare: bool = False) -> list[str]:
    """"n:ClassName(state_key)" for each callback: the n-th of its class and state_key in the
    list ("n:ClassName" with no state_key, or `bare`: as checkpoints before state_key had)."""
    seen: dict[str, int] = {}
    keys = []
    for cb in callbacks:
        own = None if bare else getattr(cb, "state_key", None)
        name = f"{type(cb).__name__}({own})" if own else type(cb).__name__
        keys.append(f"{seen.get(name, 0)}:{name}")
        seen[name] = seen.get(name, 0) + 1
    return keys


def _by_class(state: Mapping[str, Any]) -> dict[str, Any]:
    """Saved callback states under "n:ClassName" keys. Checkpoints of earlier saferun keyed
    them by the position in the whole list ("3:EarlyStopping"); in key order, the n-th state
    of a class is the n-th callback of that class either way."""
    def position(key: str) -> tuple[int, str]:
        index, _, name = key.partition(":")
        return (int(index) if index.isdigit() else 0, name)

    seen: dict[str, int] = {}
    out = {}
    for key in sorted(state, key=position):
        name = position(key)[1]
        out[f"{seen.get(name, 0)}:{name}"] = state[key]
        seen[name] = seen.get(name, 0) + 1
    return out
