"""The Trainer: owns the loop and applies the mode and gradient discipline.

Users subclass `Trainer` and override the task hooks (`build_model`,
`build_datasets`, `training_step`, `validation_step`, and optionally
`build_collate_fn`, `build_dataloaders`, `build_optimizer`, `build_scheduler`, `finish_validation`,
`after_fit`, `predict_step`, `batch_size`). The loop itself (`fit`, `train_step`, `validate`) is not an
override point; callbacks observe it (see `saferun.callbacks`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import logging
import math
import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Mapping  # isinstance on it is twice as fast as on typing.Mapping
from typing import Any, Callable, ContextManager, Iterator, Optional, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from . import __version__, distributed, modes, rundir
from .buffers import BufferSnapshot
from .callbacks import Callback, CallbackList, Control, StepOutput, TrainerView, _merge, agree
from .checkpoint import (CheckpointError, checkpoint_root, list_checkpoints, load_checkpoint,
                         load_latest, rotate, save_checkpoint, save_weights)
from .compile import check_compiled, check_compiled_training, unwrap_compiled
from .config import Config, check_resume_config, load_config
from .data import (IndexRecorder, ShardedStream, batch_size_of, check_dataset, check_stream,
                   epoch_state, make_loader, move_to_device, restore_epoch_state,
                   resume_limits, set_loader_epoch, to_host)
from .errors import ConfigError, SaferunError
from .loggers import LogLines, ProgressBar, ensure_log_handler, want_progress_bar
from .metrics import RunningTrainMetrics, WeightedMeans, scalar_dict
from .precision import autocast_factory, grad_scaler
from .preemption import Preempted, StopSignals, shielded_iter, signal_name
from .preflight import check_batch_on_cpu, check_loader
from .purity import changed as purity_changed
from .purity import diff, find_inference_tensors, fingerprint
from .schedules import Schedule, configured_hyperparameters, use_configured_hyperparameters
from .spikes import SpikeDetector
from .sync_audit import SyncAudit
from .replay import first_nonfinite, replay
from .seeding import derive_seed, get_rng_state, preserved_rng, seed_everything, set_rng_state

log = logging.getLogger("saferun")


@dataclass
class LoopState:
    """The loop's counters and latest metrics; callbacks read it through `TrainerView`."""

    step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0
    samples_seen: int = 0
    max_steps: int = 0
    run_dir: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    rank: int = 0
    world_size: int = 1


class Trainer:
    """Owns the training loop. Subclass it and override the task hooks.

    Args:
        cfg: a `Config`, a nested dict or an OmegaConf node; validated at once.
        callbacks: observers of the loop, called in list order.
    """

    def __init__(self, cfg: Config | Mapping[str, Any] | Any | None = None,
                 callbacks: Sequence[Callback] = ()) -> None:
        self.cfg = load_config(cfg)
        self.ranks = distributed.ranks_from_env()
        self.device = _resolve_device(self.cfg.trainer.device, self.ranks.local_rank)
        self.model: nn.Module = None  # type: ignore[assignment]  # built by setup()
        self.optimizer: torch.optim.Optimizer = None  # type: ignore[assignment]
        self.scheduler: Optional[torch.optim.lr_scheduler.LRScheduler] = None
        self.train_loader: Optional[DataLoader] = None
        self.val_loader: Optional[DataLoader] = None
        self.state = LoopState(max_steps=self.cfg.trainer.max_steps,
                               config=dataclasses.asdict(self.cfg), rank=self.ranks.rank,
                               world_size=self.ranks.world_size)
        self.view = TrainerView(self.state)
        self._user_callbacks = list(callbacks)
        self._best: Optional[tuple[float, str]] = None  # (value, checkpoint path) of save_best
        self._resume_rng: Optional[dict[str, Any]] = None
        self._epoch_start: Optional[dict[str, Any]] = None  # what this epoch is drawn from
        self._resume_epoch_start: Optional[dict[str, Any]] = None
        self._pending_resume: Optional[tuple[Path, dict[str, Any]]] = None  # found by setup
        self._untrained_auto = False  # resume=auto found nothing: the weights are the initial ones
        self._rollbacks = 0
        self._skips_in_a_row, self._last_skipped = 0, -1
        self._agreed_signal: Optional[int] = None
        self._pending: Optional[Control] = None  # under torchrun: requests not yet agreed
        self._mid_step = False  # a step's batches are out and the loop has not asked for more
        self._owed: Optional[dict[str, Any]] = None  # a step's end that a stop interrupted
        self._validated_at = -1  # the step of the last completed validation
        self._is_setup = False

    # ------------------------------------------------------------------ task hooks

    def build_model(self) -> nn.Module:
        """Return the model. Default: instantiate the `model` config node."""
        return self._instantiate("model", self._node("model", "build_model"))

    def build_datasets(self) -> tuple[Dataset, Optional[Dataset]]:
        """Return (train dataset, validation dataset or None). Default: the `data` node."""
        datasets = self._instantiate("data", self._node("data", "build_datasets"))
        if isinstance(datasets, Dataset):
            return datasets, None
        train, val = datasets
        return train, val

    def build_dataloaders(self, train: Dataset, val: Optional[Dataset]
                          ) -> tuple[DataLoader, Optional[DataLoader]]:
        """Return (train loader, val loader or None), seeded and pinned per the config."""
        t = self.cfg.trainer
        common = dict(num_workers=t.num_workers, seed=self.cfg.seed, rank=self.state.rank,
                      world_size=self.state.world_size, pin_memory=self._pin_memory(),
                      multiprocessing_context=t.multiprocessing_context,
                      collate_fn=self.build_collate_fn())
        train_loader = make_loader(train, batch_size=t.batch_size, shuffle=t.shuffle,
                                   drop_last=t.drop_last, **common)
        val_loader = None
        if val is not None:
            val_loader = make_loader(val, batch_size=t.val_batch_size or t.batch_size,
                                     shuffle=False, drop_last=False, evaluation=True, **common)
        return train_loader, val_loader

    def build_collate_fn(self) -> Optional[Callable[[list[Any]], Any]]:
        """Return the function that turns a list of samples into a batch, used by the training,
        validation and predict loaders, or None for torch's default. Default: the `collate_fn`
        node. With workers it must pickle (a module-level function, or an instance of a
        module-level class): the preflight names what does not."""
        if self.cfg.collate_fn is None:
            return None
        return self._instantiate("collate_fn", self.cfg.collate_fn)

    def build_optimizer(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        """Return the optimizer over the trainable `params`. Default: the `optim` node."""
        from hydra.utils import instantiate

        try:
            return instantiate(self.cfg.optim, params=params)
        except Exception as e:
            raise ConfigError(f"optim: could not build {self.cfg.optim.get('_target_')}: "
                              f"{_root_cause(e)}. Check the keys under optim.") from None

    def build_scheduler(self, optimizer: torch.optim.Optimizer
                        ) -> Optional[torch.optim.lr_scheduler.LRScheduler]:
        """Return an LR scheduler, or None. Default: the `sched` node. It is stepped once per
        optimizer step that ran; a ReduceLROnPlateau after each validation, with the metric
        trainer.sched_metric names."""
        if self.cfg.sched is None:
            return None
        from hydra.utils import instantiate

        try:
            return instantiate(self.cfg.sched, optimizer=optimizer)
        except Exception as e:
            raise ConfigError(f"sched: could not build {self.cfg.sched.get('_target_')}: "
                              f"{_root_cause(e)}. Check the keys under sched.") from None

    def training_step(self, batch: Any) -> torch.Tensor | Mapping[str, torch.Tensor]:
        """Return the scalar loss, or a dict with 'loss' plus other scalars to log."""
        raise SaferunError(f"{type(self).__name__} must override training_step(batch) "
                           f"and return the loss.")

    def validation_step(self, batch: Any) -> Mapping[str, torch.Tensor]:
        """Return a dict of scalar metrics; saferun averages them weighted by batch size."""
        raise SaferunError(f"{type(self).__name__} has a validation dataset but does not "
                           f"override validation_step(batch).")

    def finish_validation(self, metrics: dict[str, float]) -> dict[str, float]:
        """Turn the batch-size-weighted means of validation_step's values into the reported
        metrics; add what is not a mean (rmse = sqrt(mse), perplexity = exp(loss)). Default: as is."""
        return metrics

    def after_fit(self, metrics: dict[str, float]) -> None:
        """Called once training ended normally, with the final metrics and the trained model
        (on rank 0 under torchrun): e.g. print a sample. Default: nothing."""

    def predict_step(self, batch: Any) -> Any:
        """Return the model's output for `batch`. Default: model(batch), or model(batch[0])."""
        if isinstance(batch, (tuple, list)):
            return self.model(batch[0])
        return self.model(batch)

    def batch_size(self, batch: Any) -> int:
        """Samples in `batch`: the first dimension of its first tensor. Override if not."""
        return batch_size_of(batch)

    # ------------------------------------------------------------------ the loop

    def setup(self) -> None:
        """Seed, then build the model, data, optimizer and scheduler (once)."""
        if self._is_setup:
            return
        t = self.cfg.trainer
        ensure_log_handler()
        distributed.start(self.ranks, self.device, t.collective_timeout)
        seed_everything(self.cfg.seed)  # the same on every rank: identical initial weights
        model = self.build_model()
        if not isinstance(model, nn.Module):
            raise SaferunError(f"build_model() returned {type(model).__name__}, not an nn.Module.")
        model = unwrap_compiled(model)
        self._frozen = modes.resolve_modules(model, t.frozen_modules)
        modes.freeze(self._frozen)
        self.model = model.to(self.device)
        if self.ranks.world_size > 1:
            seed_everything(derive_seed(self.cfg.seed, self.ranks.rank))  # dropout etc. per rank
        train_set, val_set = self.build_datasets()
        check_dataset(train_set, "training")
        if val_set is not None:
            check_dataset(val_set, "validation")
            if hasattr(val_set, "__len__") and len(val_set) < self.ranks.world_size:
                raise SaferunError(
                    f"the validation dataset has {len(val_set)} samples for "
                    f"{self.ranks.world_size} processes: every rank needs at least one.")
        self.train_loader, self.val_loader = self.build_dataloaders(train_set, val_set)
        limits = resume_limits(self.train_loader)
        if limits:
            log.warning("The training DataLoader cannot be resumed exactly: a run resumed from a "
                        "checkpoint would not equal an uninterrupted one (resume is not exact). "
                        "%s.", "; ".join(limits))
        check_stream(self.train_loader, self.ranks.world_size)
        stream = self.train_loader.dataset
        self._uneven_data = (self.ranks.world_size > 1 and isinstance(stream, ShardedStream)
                             and stream.presplit)
        self._params = [p for p in model.parameters() if p.requires_grad]
        if not self._params:
            raise SaferunError("the model has no trainable parameters (all are frozen or have "
                               "requires_grad=False). Check trainer.frozen_modules.")
        self.optimizer = self.build_optimizer(self._params)
        _check_optimizer_params(self.optimizer, model)
        self.scheduler = self.build_scheduler(self.optimizer)
        self._schedule = Schedule(self.optimizer, self.scheduler, t.sched_metric,
                                  validates=self.val_loader is not None)
        self._scaler = grad_scaler(self.device, t.precision)
        self._autocast = autocast_factory(self.device, t.precision)
        self._non_blocking = self.device.type == "cuda"
        self.state.run_dir = t.run_dir or os.path.join(
            "runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
        self._callbacks = CallbackList(self._user_callbacks + self._configured_callbacks())
        self._running = RunningTrainMetrics()
        self._stop_signals = StopSignals()
        self._setup_guards()
        if self.val_loader is not None and type(self).validation_step is Trainer.validation_step:
            self.validation_step(None)  # raises the "override validation_step" error now
        if t.compile:
            self.model.compile(backend=t.compile_backend)
        self._ddp: Optional[distributed.GradientSync] = None
        if self.ranks.world_size > 1:
            self._ddp = distributed.GradientSync(self.model, self.device, t.find_unused_parameters)
        self._find_resume()  # resume applies to every entry point: fit, validate, predict
        self._is_setup = True

    def _setup_guards(self) -> None:
        t, g = self.cfg.trainer, self.cfg.guards
        # fp16: a non-finite gradient is the GradScaler's normal signal to skip a step.
        self._grads_checked = t.precision != "fp16"
        self._skip_nonfinite = g.nonfinite == "skip"  # fp16: a non-finite loss (a bad batch)
        self._skip_spikes = g.spikes == "skip"
        # A skipped step must also undo what its forward wrote into buffers (BatchNorm statistics).
        self._snapshot = BufferSnapshot(self.model) if self._skip_nonfinite or self._skip_spikes else None
        self._unused_check_pending = g.unused_params
        self._spikes = None
        if g.spikes != "off":
            self._spikes = {k: SpikeDetector(g.spike_window, g.spike_threshold, g.spike_warmup)
                            for k in ("loss", "grad_norm")}
        self._declared = modes.DeclaredModes(self.model, self._frozen) if g.declared_modes else None
        self._check_first_batch = False
        if g.preflight:
            for loader in (self.train_loader, self.val_loader):
                if loader is not None:
                    report = check_loader(loader)
                    for warning in report.warnings:
                        log.warning("DataLoader preflight: %s", warning)
                    report.raise_errors()
            self._check_first_batch = self.train_loader is not None and self.train_loader.num_workers > 0

    def fit(self) -> dict[str, float]:
        """Train for `trainer.max_steps` steps; return the final metrics."""
        self.setup()
        t, state, cbs = self.cfg.trainer, self.state, self._callbacks
        self._begin_run()
        try:
            self._start_training()
            cbs.on_fit_start(self.view)
            with self._stop_signals:
                control, validated = self._owed_step_end()  # resumed from a stop in validation
                # (no local name for the generator: a stop must close it, and its workers, at once)
                for micro_batches, epoch_end, where in (
                        () if control and control.stop else self._batch_groups()):
                    output = self.train_step(micro_batches)
                    self._running.add(output, where)
                    control = self._rank_local(cbs.on_train_step_end(self.view, output))
                    if state.step % t.log_every_n_steps == 0:
                        control = _merge(control, self._log())
                    validated = bool(control and control.evaluate) or self._validation_due(epoch_end)
                    control = self._end_step(control, validated)
                    if (control and control.stop) or state.step >= t.max_steps:
                        break
                if self._running.steps:
                    self._log()
                if not validated:
                    self._validate_and_report(Control(stop=True))  # the loop has ended
                self._save_final()
            cbs.on_fit_end(self.view, dict(state.metrics))
            if self.ranks.is_main:
                self.after_fit(dict(state.metrics))
        except BaseException as exc:
            with self._stop_signals.while_stopping():  # the second Ctrl-C, during the save too
                error = self._preempted(exc) or _explained(exc, state.step + 1) or exc
                cbs.on_exception(self.view, error)
            if error is exc:
                raise
            raise error from (None if isinstance(error, Preempted) else exc)
        finally:
            self._run_dir_lock.release()
        return dict(state.metrics)

    def train_step(self, micro_batches: Sequence[Any]) -> StepOutput:
        """One optimizer step over `micro_batches`. Reads top to bottom."""
        opt, scaler = self.optimizer, self._scaler
        if self._snapshot is not None:
            self._snapshot.take()  # under a skip policy: the buffers as before this step
        loss, logs, samples = self._forward_backward(micro_batches)
        if self._declared is not None:
            self._declared.check(self.state.step + 1)
        scaler.unscale_(opt)  # clip and measure the true gradients, not the fp16-scaled ones
        grad_norm = _clip_or_measure(self._params, self.cfg.trainer.max_grad_norm)
        if self._unused_check_pending:
            self._report_unused_parameters()
        spike, loss_spike = self._spike(loss, grad_norm) if self._spikes else (None, None)  # device
        if (self._skip_nonfinite or self._skip_spikes) and self._bad_now(loss, grad_norm, spike):
            return self._skip_step(loss, grad_norm, samples)  # one host sync per step
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        self._schedule.after_step()  # steps the scheduler if the optimizer stepped (GradScaler)
        self.state.step += 1
        self.state.samples_seen += samples
        return StepOutput(loss=loss, grad_norm=grad_norm, logs=logs, num_samples=samples,
                          spike=spike, loss_spike=loss_spike)

    def _forward_backward(self, micro_batches: Sequence[Any]
                          ) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
        """Forward and backward over the micro-batches: (mean loss, mean logs, samples)."""
        sizes = [self.batch_size(b) for b in micro_batches]
        total = sum(sizes)
        loss_sum: Optional[torch.Tensor] = None
        logs_sum: dict[str, torch.Tensor] = {}
        for i, (batch, size) in enumerate(zip(micro_batches, sizes)):
            batch = move_to_device(batch, self.device, self._non_blocking)
            with self._data_parallel(last=i == len(sizes) - 1):
                with self._autocast():
                    loss, logs = _loss_and_logs(self.training_step(batch), self.state.step + 1)
                # Weight each micro-batch by its share of the samples, so that the accumulated
                # gradient equals the gradient of the whole batch's mean loss.
                if size != total:
                    loss, logs = loss * (size / total), {k: v * (size / total) for k, v in logs.items()}
                self._scaler.scale(loss).backward()
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
            for k, v in logs.items():
                logs_sum[k] = logs_sum[k] + v if k in logs_sum else v
        assert loss_sum is not None
        return loss_sum, logs_sum, total

    def validate(self) -> dict[str, float]:
        """Average `validation_step` over the validation set, in eval mode without autograd."""
        self.setup()
        self._check_evaluated_weights("validate")
        if self.val_loader is None:
            return {}
        limit = self.cfg.trainer.limit_val_batches
        means = WeightedMeans()
        set_loader_epoch(self.val_loader, self.cfg.seed, 0, self.state.rank)
        before = fingerprint(self.model) if self.cfg.guards.eval_purity else None
        # preserved_rng: randomness in validation must not shift training's random streams,
        # or the training results would depend on how often you validate.
        with self._evaluating(), preserved_rng():
            for i, batch in enumerate(shielded_iter(self.val_loader)):
                if limit is not None and i >= limit:
                    break
                if self.ranks.world_size == 1 and self._stop_signals.received is not None:
                    raise _StopRequested  # preemption must not wait for a long evaluation
                out = self.validation_step(move_to_device(batch, self.device, self._non_blocking))
                means.add(scalar_dict(out, "validation_step"), self.batch_size(batch))
        probe = {"changed": purity_changed(before, fingerprint(self.model))} if before else {}
        values, flags = means.read(probe, self.device)  # one read: the means and the purity flag
        self._check_purity(before, flags.get("changed", 0.0))
        metrics = {f"val/{k}": v for k, v in self.finish_validation(values).items()}
        self.state.metrics.update(metrics)
        return metrics

    def predict(self, data: Dataset | DataLoader) -> Any:
        """Run `predict_step` over `data` in eval mode without autograd; outputs on the CPU.

        Tensors are concatenated along the batch dimension; other outputs come back as a list
        (one entry per batch) with every tensor inside on the CPU, usable in autograd.
        """
        self.setup()
        self._check_evaluated_weights("predict")
        loader = data if isinstance(data, DataLoader) else DataLoader(
            data, batch_size=self.cfg.trainer.val_batch_size or self.cfg.trainer.batch_size,
            collate_fn=self.build_collate_fn())
        outputs = []
        before = fingerprint(self.model) if self.cfg.guards.eval_purity else None
        with self._evaluating():
            for batch in loader:
                outputs.append(self.predict_step(move_to_device(batch, self.device,
                                                                self._non_blocking)))
        if before is not None:
            self._check_purity(before, float(purity_changed(before, fingerprint(self.model))))
        # Outside inference mode, cat/clone turn inference tensors into normal ones,
        # which the caller may later use in autograd.
        if outputs and all(isinstance(o, torch.Tensor) for o in outputs):
            return torch.cat(outputs).cpu()
        return [to_host(o) for o in outputs]

    # ------------------------------------------------------------------ loop helpers

    def _data_parallel(self, last: bool) -> ContextManager[None]:
        """Under torchrun, average the gradients over ranks once per optimizer step, after
        the last micro-batch's backward, whatever training_step calls (see GradientSync)."""
        return _NO_CONTEXT if self._ddp is None else self._through_ddp(last)

    @contextlib.contextmanager
    def _through_ddp(self, last: bool) -> Iterator[None]:
        assert self._ddp is not None
        module, self.model = self.model, self._ddp.model  # the DDP wrapper, unless bypassed
        try:
            with self._ddp.micro_batch(last, self.state.step + 1):
                yield
        finally:
            self.model = module

    def _evaluating(self) -> contextlib.ExitStack:
        """Eval mode (every submodule's flag restored after), no autograd, autocast."""
        stack = contextlib.ExitStack()
        stack.enter_context(modes.evaluating(self.model, self.cfg.trainer.eval_grad_mode))
        stack.enter_context(self._autocast())
        return stack

    def _check_purity(self, before: Any, changed: float) -> None:
        """guards.eval_purity: raise naming what evaluation changed or left on the model."""
        if before is None:
            return
        problems = diff(before, fingerprint(self.model)) if changed else []
        if self.cfg.trainer.eval_grad_mode == "inference_mode":
            problems += find_inference_tensors(self.model)  # metadata only: no sync
        if problems:
            raise SaferunError(
                f"evaluation changed the model (guards.eval_purity), at step {self.state.step}:\n"
                + "\n".join(f"  - {p}" for p in problems) + "\nEvaluation must leave parameters "
                "and buffers as it found them; a module that changes state in eval mode makes "
                "validation results and later training depend on how often you validate.")

    def _batch_groups(self) -> Iterator[tuple[list[Any], bool, Any]]:
        """Yield (micro-batches of one step, is it the epoch's last step, where) across epochs.

        `where` is (epoch, [sample indices of each micro-batch]), or None when the
        loader does not record indices (a user-built DataLoader).

        After a resume, the RNG and sampler states of the interrupted epoch's start are
        put back, the epoch replays its batches up to the saved position (loading only,
        no compute; the same order, and workers draw the same augmentations again), then
        the step's RNG states are restored: the run continues exactly as if it had not
        stopped, with saferun's loaders and with loaders built by the user.
        """
        t, state = self.cfg.trainer, self.state
        loader = self.train_loader
        assert loader is not None
        per_epoch = len(loader) if hasattr(loader.dataset, "__len__") else None
        recorder = loader.batch_sampler if isinstance(loader.batch_sampler, IndexRecorder) else None
        while state.step < t.max_steps and (t.max_epochs is None or state.epoch < t.max_epochs):
            set_loader_epoch(loader, self.cfg.seed, state.epoch, state.rank)
            if self._resume_epoch_start is not None:  # a user-built loader draws from these
                restore_epoch_state(loader, self._resume_epoch_start)
                self._resume_epoch_start = None
            self._epoch_start = epoch_state(loader)
            batches = shielded_iter(loader)  # its workers ignore signals to the process group
            for _ in itertools.islice(batches, state.batches_in_epoch):
                if recorder is not None:
                    recorder.take()
            if self._resume_rng is not None:
                set_rng_state(self._resume_rng)
                self._resume_rng = None
            while state.step < t.max_steps and (group := self._next_group(batches)):
                if self._check_first_batch:
                    check_batch_on_cpu(group[0])  # what the first worker batch holds
                    self._check_first_batch = False
                state.batches_in_epoch += len(group)
                where = (state.epoch, [recorder.take() for _ in group]) if recorder else None
                self._mid_step = True  # until the loop asks for the next step (see _preempted)
                yield group, per_epoch is not None and state.batches_in_epoch >= per_epoch, where
                self._mid_step = False
            if state.step >= t.max_steps:
                return
            if state.batches_in_epoch == 0:
                raise SaferunError(
                    f"the training DataLoader yielded no batches in epoch {state.epoch}. With "
                    f"drop_last=True it needs at least batch_size={t.batch_size} samples.")
            state.epoch += 1
            state.batches_in_epoch = 0

    def _next_group(self, batches: Iterator[Any]) -> list[Any]:
        """The next step's micro-batches; [] at the epoch's end. Shards of a stream that
        splits itself may differ in length: the ranks agree, so that the epoch ends for all
        of them when one runs out (a rank left waiting in the gradient all-reduce would hang)."""
        group = _take(batches, self.cfg.trainer.accumulate)
        if self._uneven_data and not distributed.on_every_rank(bool(group)):
            return []
        return group

    def _start_training(self) -> None:
        """Train mode for everything except frozen modules; say so if the model was in eval."""
        if modes.set_train_modes(self.model, self._frozen):
            frozen = ", ".join(self.cfg.trainer.frozen_modules) or "none declared"
            log.info("The model was in eval mode (as pretrained loaders often return it); "
                     "saferun put it in train mode. Frozen modules kept in eval: %s.", frozen)
        if self.cfg.trainer.compile:
            self._check_compile()
        g = self.cfg.guards
        if (g.nonfinite == "rollback" or g.anomaly_replay) and \
                not list_checkpoints(checkpoint_root(self.state.run_dir)):
            self._save_checkpoint()  # so there is always a good state to go back to

    def _check_compile(self) -> None:
        """Compiled against eager on the first training batch: the loss in eval mode; the loss,
        gradients and buffers in training mode. Leaves the model, its gradients, its modes,
        every RNG and the loader's generators as it found them."""
        loader, t = self.train_loader, self.cfg.trainer
        assert loader is not None
        found = epoch_state(loader)
        try:
            set_loader_epoch(loader, self.cfg.seed, 0, self.state.rank)
            batch = move_to_device(next(shielded_iter(loader)), self.device, self._non_blocking)
        finally:
            restore_epoch_state(loader, found)

        def eval_loss() -> torch.Tensor:
            with self._evaluating():
                return _loss_and_logs(self.training_step(batch), 1, need_grad=False)[0]

        def train_loss() -> torch.Tensor:
            with self._autocast():
                loss = _loss_and_logs(self.training_step(batch), 1)[0]
            loss.backward()
            return loss

        with preserved_rng():
            check_compiled(eval_loss, t.compile_rtol, t.compile_atol)
        with modes.training(self.model, self._frozen):
            check_compiled_training(train_loss, self.model, t.compile_rtol, t.compile_atol)

    def _validation_due(self, epoch_end: bool) -> bool:
        if self.val_loader is None:
            return False
        every = self.cfg.trainer.val_every_n_steps
        return epoch_end if every is None else self.state.step % every == 0

    def _validate_and_report(self, pending: Optional[Control] = None) -> Optional[Control]:
        """Validate and tell the callbacks. `pending`: what the step still has to do after
        validation; a stop during validation saves it with the checkpoint, as owed."""
        if not self._window_finite():
            return None  # rolled back: the state this validation was for is gone
        self._owed = {"step": self.state.step, "save": bool(pending and pending.save),
                      "stop": bool(pending and pending.stop)}
        metrics = self.validate()
        self._owed, self._validated_at = None, self.state.step
        if not metrics:
            return None
        self._schedule.after_validation(metrics)  # a ReduceLROnPlateau, with trainer.sched_metric
        control = self._agreed(self._callbacks.on_validation_end(self.view, metrics))
        best = self.cfg.trainer.save_best
        if best is not None and self._improves(metrics, best):
            self._save_checkpoint(best=metrics[best])
        return control

    def _end_step(self, control: Optional[Control], validate: bool) -> Optional[Control]:
        """The rest of a step after its log point: validation (if due or asked), a save (if
        due or asked), and a stop on a signal, raised here, at the step boundary."""
        if validate:
            control = _merge(control, self._validate_and_report(control))
        if (control and control.save) or self._save_due():
            self._save_checkpoint()
        if self._stop_agreed():
            raise _StopRequested
        return control

    def _owed_step_end(self) -> tuple[Optional[Control], bool]:
        """Resumed from a checkpoint saved when a stop interrupted a validation: end that
        step as the uninterrupted run did (validate, callbacks, save, stop). Returns the
        step's control and whether this step's validation is done."""
        owed, self._owed = self._owed, None
        if owed is None or owed["step"] != self.state.step:
            # a checkpoint of a finished run: its final validation is done, not to be redone
            return None, self._validated_at == self.state.step
        log.info("Resumed from a stop during validation at step %d: validating first.",
                 self.state.step)
        return self._end_step(Control(save=owed["save"], stop=owed["stop"]), True), True

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The whole training state: what `load_state_dict` needs to continue exactly.

        Under torchrun every rank must call it (it gathers each rank's RNG states and
        pending metrics onto rank 0); on the other ranks `per_rank` is None.
        """
        s = self.state
        assert self.train_loader is not None
        # Before an epoch has started (or after the last one ended) the next one starts from now;
        # right after a resume, before the loop restarted, from the loaded checkpoint's start.
        epoch_start = ((self._resume_epoch_start or self._epoch_start) if s.batches_in_epoch
                       else epoch_state(self.train_loader))
        # Resumed but not trained yet (a finished run resumed): the loaded RNG states are the
        # run's, not the ones this process was seeded with.
        rng = self._resume_rng if self._resume_rng is not None else get_rng_state()
        mine = move_to_device({"rng": rng, "running": self._running.state_dict(),
                               # spike detectors: each rank sees its own loss
                               "spikes": {k: d.state_dict() for k, d in (self._spikes or {}).items()},
                               "epoch_start": epoch_start}, torch.device("cpu"))
        per_rank = distributed.gather(mine)
        return {
            "format": 1,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self._scaler.state_dict(),
            "loop": {"step": s.step, "epoch": s.epoch, "batches_in_epoch": s.batches_in_epoch,
                     "samples_seen": s.samples_seen, "metrics": dict(s.metrics),
                     "best": list(self._best) if self._best else None,
                     # a stop interrupted this step's validation: the resumed run does it first
                     "owed": self._owed if self._owed and self._owed["step"] == s.step else None,
                     "validated_at": self._validated_at},
            "per_rank": per_rank,  # [{"rng", "running", "spikes", "epoch_start"}] per rank
            "callbacks": self._callbacks.state_dict(),
            "config": dataclasses.asdict(self.cfg),
            "provenance": {"saferun": __version__, "torch": str(torch.__version__),
                           "python": platform.python_version()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()`'s result. RNG states apply when training resumes."""
        self.setup()
        self._pending_resume, self._untrained_auto = None, False  # this state replaces it
        self._load_model(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:
            self._scaler.load_state_dict(state["scaler"])
        loop = state["loop"]
        for key in ("step", "epoch", "batches_in_epoch", "samples_seen"):
            setattr(self.state, key, loop[key])
        self.state.metrics.update(loop["metrics"])
        self._best = tuple(loop["best"]) if loop["best"] else None  # type: ignore[assignment]
        self._owed = loop.get("owed")  # absent from older checkpoints
        self._validated_at = loop.get("validated_at", -1)
        if len(state["per_rank"]) != self.ranks.world_size:
            raise CheckpointError(
                f"the checkpoint was written by {len(state['per_rank'])} process(es) and this run "
                f"has {self.ranks.world_size}: each rank's RNG states and data shard would differ. "
                f"Resume with the same number of processes.")
        mine = state["per_rank"][self.ranks.rank]
        self._running.load_state_dict(move_to_device(mine["running"], self.device))
        self._callbacks.load_state_dict(state["callbacks"])
        spikes = mine.get("spikes", state.get("guards", {}))  # "guards": saferun 0.1's, rank 0's
        for key, detector in (self._spikes or {}).items():
            if key in spikes:
                detector.load_state_dict(move_to_device(spikes[key], self.device))
        self._resume_rng = mine["rng"]
        self._resume_epoch_start = mine.get("epoch_start")  # absent from older checkpoints

    def _begin_run(self) -> None:
        """Check and lock the run directory (one writer at a time), resume, and only then,
        with the run accepted, record its config in <run_dir>/config.yaml."""
        self._run_dir_lock = rundir.claim(self.state.run_dir, self.ranks.is_main)
        try:
            self._resume()
            if self.ranks.is_main:
                rundir.write_config(self.state.run_dir, dataclasses.asdict(self.cfg))
        except BaseException:
            self._run_dir_lock.release()
            raise

    def _find_resume(self) -> None:
        """Find the checkpoint `cfg.resume` names (auto or a path) and load its weights, so that
        every entry point uses them; `fit` then restores the rest (`_resume`)."""
        resume = self.cfg.resume
        if resume is None:
            return
        where = Path(self.state.run_dir) if resume == "auto" else Path(resume)
        if (where / "manifest.json").is_file():
            found: Optional[tuple[Path, dict[str, Any]]] = (where, load_checkpoint(where))
        else:
            root = where if where.name == "checkpoints" else checkpoint_root(where)
            found = load_latest(root)
        if found is None:
            if resume != "auto":
                raise CheckpointError(f"resume={resume}: no complete checkpoint there.")
            log.info("resume=auto: no checkpoint in %s yet; starting fresh.", where)
            self._untrained_auto = True
            return
        state = found[1]
        # Evaluation needs only the same model; continuing training needs the whole config.
        check_resume_config(state["config"], dataclasses.asdict(self.cfg), self.cfg.force_resume,
                            keys=("model", "task"), purpose="use the checkpoint's weights")
        self._load_model(state["model"])
        for key in ("step", "epoch", "batches_in_epoch", "samples_seen"):
            setattr(self.state, key, state["loop"][key])
        self._pending_resume = found

    def _resume(self) -> None:
        """Continue training from the checkpoint found by setup, after checking the config."""
        found, self._pending_resume = self._pending_resume, None
        self._untrained_auto = False  # fit trains them
        if found is None:
            return
        path, state = found
        config = dataclasses.asdict(self.cfg)
        check_resume_config(state["config"], config, self.cfg.force_resume)
        forced = [k for k in ("optim", "sched") if state["config"].get(k) != config[k]]
        configured = configured_hyperparameters(self.optimizer, self.scheduler) if forced else None
        self.load_state_dict(state)
        log.info("Resumed from %s: step %d, epoch %d, batch %d of the epoch.", path,
                 self.state.step, self.state.epoch, self.state.batches_in_epoch)
        if configured is not None:  # force_resume with a new optim/sched: what was asked applies
            steps = (state["scheduler"] or {}).get("last_epoch", self.state.step)
            use_configured_hyperparameters(self.optimizer, self.scheduler, configured, steps)
            log.warning("force_resume: %s changed; the optimizer now uses the configured values "
                        "(learning rate %s at step %d), its moments are the checkpoint's.",
                        ", ".join(forced), self.optimizer.param_groups[0]["lr"], self.state.step)

    def _check_evaluated_weights(self, entry: str) -> None:
        if self._untrained_auto:
            raise SaferunError(
                f"{entry}(): resume=auto found no checkpoint in {self.state.run_dir}, so it would "
                f"evaluate the untrained initial weights. Set resume to the run directory or "
                f"checkpoint to evaluate (e.g. resume=runs/exp1), or resume=null to evaluate the "
                f"initial weights on purpose.")

    def _load_model(self, weights: Mapping[str, torch.Tensor]) -> None:
        try:
            self.model.load_state_dict(weights)
        except RuntimeError as e:
            raise CheckpointError(f"the checkpoint's weights do not fit this model: {e}") from None

    def _save_checkpoint(self, best: Optional[float] = None) -> Path:
        """Save the state; `best`: this is save_best's new best checkpoint, with that value."""
        t = self.cfg.trainer
        root = checkpoint_root(self.state.run_dir)
        # A checkpoint is only saved if the steps since the last check were finite, so the
        # newest checkpoint is always a good state to resume or roll back to.
        if not self._window_finite():
            return list_checkpoints(root)[-1]  # rolled back to it
        path = root / f"step-{self.state.step:08d}"
        if best is not None:  # before state_dict(): the checkpoint records itself as the best
            self._best = (best, str(path))
        state = self.state_dict()  # under torchrun, a collective: every rank calls it
        if self.ranks.is_main:
            save_checkpoint(root, self.state.step, state)
            rotate(root, t.keep_last, keep=[Path(self._best[1])] if self._best else (), current=path)
        distributed.barrier()  # no rank goes on (or exits) before the checkpoint is complete
        self._callbacks.on_checkpoint(self.view, str(path))
        return path

    def _save_final(self) -> None:
        # Always: the final validation may have changed callback state since the last save.
        self._save_checkpoint()
        if self.ranks.is_main:
            save_weights(Path(self.state.run_dir) / "model.pt", self.model.state_dict())

    def _save_due(self) -> bool:
        every = self.cfg.trainer.save_every_n_steps
        return every is not None and self.state.step % every == 0

    def _improves(self, metrics: Mapping[str, float], key: str) -> bool:
        if key not in metrics:
            raise ConfigError(f"trainer.save_best={key!r}, but validation reports only "
                              f"{', '.join(metrics)}.")
        if self._best is None:
            return True
        return metrics[key] < self._best[0] if self.cfg.trainer.save_best_mode == "min" \
            else metrics[key] > self._best[0]

    # ------------------------------------------------------------------ bad-step guards

    def _finite(self, metrics: Mapping[str, float]) -> bool:
        """Are a log point's metrics free of non-finite values and of flagged spikes?"""
        keys = ("train/loss", "train/param_norm") + (("train/grad_norm",) if self._grads_checked else ())
        if self.cfg.guards.nonfinite != "off" and not all(
                math.isfinite(metrics[k]) for k in keys if k in metrics):
            return False
        return metrics.get("train/spikes", 0.0) == 0.0 or self.cfg.guards.spikes == "skip"

    def _window_finite(self) -> bool:
        """Check the steps since the last log point (one host sync); False after a rollback."""
        g = self.cfg.guards
        if (g.nonfinite == "off" and g.spikes in ("off", "skip")) or not self._running.losses:
            return True
        if self._running.first_bad(g.nonfinite != "off", self._grads_checked, self.ranks) is None:
            return True
        self._on_nonfinite()  # raises, or rolls back
        return False

    def _spike(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the loss or the gradient norm spiked, the loss spiked), on the device."""
        assert self._spikes is not None
        loss_spike = self._spikes["loss"].update(loss)
        return loss_spike | self._spikes["grad_norm"].update(grad_norm), loss_spike

    def _bad_now(self, loss: torch.Tensor, grad_norm: torch.Tensor,
                 spike: Optional[torch.Tensor]) -> bool:
        """For the skip policies: is this step bad? Reads one value from the device."""
        bad = torch.zeros((), dtype=torch.bool, device=loss.device)
        if self._skip_nonfinite:
            # NaN and Inf survive the sum; under fp16 the GradScaler handles the gradients
            bad |= ~torch.isfinite(loss + grad_norm if self._grads_checked else loss)
        if self._skip_spikes and spike is not None:
            bad |= spike
        return bool(distributed.all_reduce(bad.int()))  # under torchrun: bad on any rank

    def _on_nonfinite(self) -> None:
        """A bad step since the last log point (non-finite or a spike): raise, or roll back."""
        running, g = self._running, self.cfg.guards
        found = (running.first_bad(g.nonfinite != "off", self._grads_checked, self.ranks)
                 if running.losses else None)
        if found is None:  # the losses and gradients were finite: guards.check_params fired
            raise NonFiniteError(
                f"the parameters are not finite at step {self.state.step}: "
                f"{first_nonfinite(self.model.named_parameters())}. Lower optim.lr or set "
                f"trainer.max_grad_norm; set guards.anomaly_replay=true to find the operation.")
        first, kind, rank = found
        key = "guards.nonfinite" if kind == "non-finite" else "guards.spikes"
        policy = g.nonfinite if kind == "non-finite" else g.spikes
        bad_step = self.state.step - running.steps + 1 + first
        # the values and samples of the rank where it started, on every rank (torchrun)
        mine = ([*torch.stack([running.losses[first], running.grad_norms[first]]).tolist(),
                 running.batches[first]] if rank == self.ranks.rank else None)
        loss, norm, where = distributed.broadcast(mine, src=rank)
        on_rank = f" on rank {rank}" if self.ranks.world_size > 1 else ""
        indices = [i for micro in (where[1] if where else ()) for i in (micro or ())]
        samples = (f"epoch {where[0]}, sample indices {_short(indices)}" if indices
                   else "sample indices unknown (a custom DataLoader)")
        what = "non-finite values" if kind == "non-finite" else (
            f"a loss spike or gradient explosion (guards.spikes, threshold "
            f"{g.spike_threshold} robust sigmas over {g.spike_window} steps)")
        report = f"{what} at step {bad_step}{on_rank}: loss {loss}, gradient norm {norm}; {samples}."
        if policy == "rollback":
            self._roll_back(report, bad_step)
            return
        replayed = ("\n" + self._anomaly_replay(bad_step)
                    if g.anomaly_replay and kind == "non-finite" else "")
        raise NonFiniteError(
            f"{report} The check runs at log points, validations and saves (no host sync per "
            f"step), so that update and any after it were applied; the last checkpoint predates "
            f"them. What to do: inspect those samples; lower optim.lr or set "
            f"trainer.max_grad_norm; set guards.anomaly_replay=true to name the operation that "
            f"produced a NaN; or set {key}=skip or {key}=rollback to train past such "
            f"steps.{replayed}")

    def _skip_step(self, loss: torch.Tensor, grad_norm: torch.Tensor, samples: int) -> StepOutput:
        """A skip policy: drop this update. Parameters, buffers, optimizer and scheduler stay as
        before the step; the GradScaler, which saw the gradients, updates its scale as usual."""
        assert self._snapshot is not None
        self._snapshot.restore()
        self.optimizer.zero_grad(set_to_none=True)
        self._scaler.update()  # ends the scaler's step after unscale_ (else the next one raises)
        self._schedule.after_step()  # the optimizer did not step: nor does the scheduler
        step = self.state.step + 1
        self._skips_in_a_row = self._skips_in_a_row + 1 if self._last_skipped == step - 1 else 1
        self._last_skipped = step
        self.state.step = step
        self.state.samples_seen += samples
        log.warning("step %d: non-finite loss or gradients, or a spike; the update was skipped "
                    "(%d in a row).", step, self._skips_in_a_row)
        if self._skips_in_a_row >= self.cfg.guards.max_consecutive:
            raise NonFiniteError(
                f"{self._skips_in_a_row} steps in a row ({step - self._skips_in_a_row + 1} to "
                f"{step}) had non-finite loss or gradients (or spiked) and were skipped "
                f"(guards.max_consecutive={self.cfg.guards.max_consecutive}). Training is not "
                f"recovering: lower optim.lr, set trainer.max_grad_norm, or check the data.")
        return StepOutput(loss=loss, grad_norm=grad_norm, num_samples=samples, skipped=True)

    def _roll_back(self, report: str, bad_step: int) -> None:
        """guards.nonfinite=rollback: restore the newest checkpoint, keep going with new data."""
        self._rollbacks += 1
        try:
            found, damaged = load_latest(checkpoint_root(self.state.run_dir)), ""
        except CheckpointError as e:
            found, damaged = None, f" ({e})"
        if found is None or self._rollbacks > self.cfg.guards.max_consecutive:
            why = (f"there is no checkpoint to roll back to{damaged}" if found is None else
                   f"{self._rollbacks} rollbacks without a clean log point in between "
                   f"(guards.max_consecutive={self.cfg.guards.max_consecutive})")
            raise NonFiniteError(f"{report} Cannot roll back: {why}. Lower optim.lr, set "
                                 f"trainer.max_grad_norm, or check the data.")
        path, state = found
        epoch, position = self.state.epoch, self.state.batches_in_epoch
        self.load_state_dict(state)
        # Go on with the data after the bad step: replaying it would fail the same way.
        self.state.epoch, self.state.batches_in_epoch = epoch, position
        self._resume_rng = self._resume_epoch_start = None
        self._running.reset()
        log.warning("%s Rolled back to %s (step %d); training continues with the data after "
                    "step %d.", report, path, self.state.step, bad_step)

    def _anomaly_replay(self, bad_step: int) -> str:
        """Re-run from the newest checkpoint to `bad_step`, then that step under anomaly mode."""
        try:
            found = load_latest(checkpoint_root(self.state.run_dir))
        except CheckpointError as e:
            return f"Anomaly replay: {e}"
        if found is None or found[1]["loop"]["step"] >= bad_step:
            return "Anomaly replay: no checkpoint before the bad step to replay from."
        self.load_state_dict(found[1])
        self._running.reset()
        for micro_batches, _, _ in self._batch_groups():
            if self.state.step + 1 == bad_step:
                return str(replay(lambda: self._forward_backward(micro_batches)[0], self.model))
            self.train_step(micro_batches)
        return "Anomaly replay: the data ended before the bad step."

    def _report_unused_parameters(self) -> None:
        """Once, after the first backward: name trainable parameters that got no gradient."""
        self._unused_check_pending = False
        unused = [n for n, p in self.model.named_parameters() if p.requires_grad and p.grad is None]
        if unused:
            log.warning(
                "%d trainable parameter(s) received no gradient in the first step: %s. "
                "training_step's loss does not depend on them; if that is intended, freeze them "
                "(trainer.frozen_modules) so that weight decay does not move them, and note that "
                "DistributedDataParallel needs find_unused_parameters=True for them.",
                len(unused), _short(unused))

    def _preempted(self, exc: BaseException) -> Optional[BaseException]:
        """After SIGTERM/SIGINT: save this step boundary and build the exit, else None.

        Only a true boundary is saved: the loop's stop (`_StopRequested`, raised between
        steps or between validation batches) or, in one process, a DataLoader worker's
        death while the loop was fetching the next step's batches. Workers are shielded
        from signals to the process group; if one dies anyway in the middle of a step,
        nothing is saved (half a step cannot be resumed exactly) and the error says so.
        """
        signum = self._stop_signals.received
        worker_died = (isinstance(exc, RuntimeError) and "DataLoader worker" in str(exc)
                       and self.ranks.world_size == 1)  # under torchrun the ranks must agree
        if signum is None or not (isinstance(exc, _StopRequested) or worker_died):
            return None
        if worker_died and self._mid_step:
            newest = list_checkpoints(checkpoint_root(self.state.run_dir))
            return SaferunError(
                f"stopped by {signal_name(signum)}, but a DataLoader worker died in the middle "
                f"of a step (after step {self.state.step}): {exc} No checkpoint was saved: a "
                f"half-done step cannot be resumed exactly. The newest checkpoint is "
                f"{newest[-1] if newest else 'none'}; resume=auto continues from it.")
        path = self._save_checkpoint()
        self._stop_signals.saved()
        owed = " (its validation was interrupted: the resumed run validates first)" \
            if self._owed else ""
        message = (f"saferun: stopped by {signal_name(signum)} at step {self.state.step}{owed}; "
                   f"checkpoint {path}. To continue, run again with the same run directory "
                   f"and resume=auto (command line: add hydra.run.dir={self.state.run_dir} "
                   f"resume=auto), or with resume={path}.")
        print(message, file=sys.stderr, flush=True)
        return Preempted(signum, message)

    def _log(self) -> Optional[Control]:
        g = self.cfg.guards
        extra = {"train/param_norm": torch.nn.utils.get_total_norm(self._params)} if g.check_params else {}
        metrics = self._running.read(extra, self._stop_votes(), self.ranks.world_size)
        self._count_stop_votes(metrics)
        if not self._finite(metrics):
            self._on_nonfinite()  # raises, or rolls back (the window's metrics are then moot)
            return None
        self._running.reset()
        self._rollbacks = 0
        metrics.update(self._schedule.rates())  # the rates the latest step used, every group
        self.state.metrics.update(metrics)
        return self._agreed(self._callbacks.on_log(self.view, metrics))

    def _rank_local(self, control: Optional[Control]) -> Optional[Control]:
        """Under torchrun, a request made between log points (on_train_step_end) waits for
        the next log point or validation, where the ranks agree on it; in one process it
        acts at once."""
        if self.ranks.world_size == 1:
            return control
        self._pending = _merge(self._pending, control)
        return None

    def _agreed(self, control: Optional[Control]) -> Optional[Control]:
        """The callbacks' requests, agreed across ranks (any rank's request counts for all:
        a logger, for one, lives on rank 0 only), so that every rank leaves the loop,
        validates and saves at the same step. A single process: `control` as is."""
        if self.ranks.world_size == 1:
            return control
        pending, self._pending = _merge(self._pending, control), None
        return agree(pending, self.device)

    def _stop_agreed(self) -> bool:
        """One process: a stop signal arrived. Under torchrun: the ranks agreed on it at the
        last log point, so that all of them save the same step and exit together."""
        if self.ranks.world_size == 1:
            return self._stop_signals.received is not None
        return self._agreed_signal is not None

    def _stop_votes(self) -> dict[str, torch.Tensor]:
        """Under torchrun: this rank's stop signal, summed over ranks with the log metrics."""
        if self.ranks.world_size == 1:
            return {}
        signum = self._stop_signals.received or 0
        return {"_stop_votes": torch.full((), float(signum > 0), device=self.device),
                "_stop_signals": torch.full((), float(signum), device=self.device)}

    def _count_stop_votes(self, metrics: dict[str, float]) -> None:
        votes, signals = metrics.pop("_stop_votes", 0.0), metrics.pop("_stop_signals", 0.0)
        if votes:
            self._agreed_signal = int(round(signals / votes))
            self._stop_signals.received = self._agreed_signal  # also on ranks that got none

    def _configured_callbacks(self) -> list[Callback]:
        """The `callbacks` nodes, then (on rank 0) the `logger` nodes and the console output."""
        callbacks: list[Callback] = []
        for key in ("callbacks", "logger") if self.ranks.is_main else ("callbacks",):
            for name, node in (getattr(self.cfg, key) or {}).items():
                if node is not None:
                    callbacks.append(self._instantiate(f"{key}.{name}", node))
        if self.ranks.is_main:
            callbacks.append(ProgressBar() if want_progress_bar(self.cfg.trainer.progress_bar)
                             else LogLines())
        if self.cfg.guards.sync_audit:
            callbacks.append(SyncAudit(self.device.type))  # last: it sees every callback's syncs
        return callbacks

    def _pin_memory(self) -> bool:
        setting = self.cfg.trainer.pin_memory
        return self.device.type == "cuda" if setting is None else setting

    def _node(self, key: str, hook: str) -> Mapping[str, Any]:
        node = getattr(self.cfg, key)
        if node is None:
            raise SaferunError(f"{type(self).__name__}.{hook}() is not overridden and the config "
                               f"has no '{key}' node. Override {hook}() or set {key}._target_.")
        return node

    @staticmethod
    def _instantiate(key: str, node: Mapping[str, Any]) -> Any:
        from hydra.utils import instantiate

        try:
            return instantiate(node)
        except Exception as e:
            raise ConfigError(f"{key}: could not build {node.get('_target_')}: {_root_cause(e)}. "
                              f"Check the keys under {key}.") from None


def _loss_and_logs(out: Any, step: int, need_grad: bool = True
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Split training_step's output into the loss and the extra scalars, checking both."""
    logs: dict[str, torch.Tensor] = {}
    if isinstance(out, Mapping):
        if "loss" not in out:
            raise SaferunError(f"training_step returned a dict without 'loss' at step {step} "
                               f"(keys: {', '.join(map(str, out))}).")
        logs = {k: v.detach() for k, v in scalar_dict(out, "training_step").items() if k != "loss"}
        out = out["loss"]
    if not isinstance(out, torch.Tensor) or out.ndim != 0:
        got = f"shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise SaferunError(f"training_step must return a scalar loss tensor; got {got} at step "
                           f"{step}. Reduce it over the batch, e.g. loss.mean().")
    if need_grad and not out.requires_grad:
        raise SaferunError(
            f"the loss at step {step} does not require grad, so backward() cannot train anything. "
            f"Was it computed under torch.no_grad(), detached, or from frozen parameters only?")
    return out, logs


_NO_CONTEXT = contextlib.nullcontext()  # reusable; cheaper than a generator per micro-batch


class _StopRequested(Exception):
    """Raised inside the loop when a stop signal arrived; fit() turns it into `Preempted`."""


def _explained(exc: BaseException, step: int) -> Optional[SaferunError]:
    """A bare torch error that saferun can explain, rewritten with the fix; else None."""
    if isinstance(exc, RuntimeError) and "Inference tensors cannot be saved" in str(exc):
        return SaferunError(
            f"step {step}: a tensor created during evaluation, which runs under "
            f"torch.inference_mode(), was used in training (typically a cache or attribute set in "
            f"forward or validation_step). Store a .clone() made outside inference mode, or set "
            f"trainer.eval_grad_mode=no_grad."
        )
    if "Cannot re-initialize CUDA in forked subprocess" in str(exc):
        return SaferunError(
            f"step {step}: a DataLoader worker used CUDA (a .cuda() or device='cuda' in the "
            f"dataset or collate_fn). Workers started with fork cannot use CUDA once the main "
            f"process has. Return CPU tensors from the dataset: saferun moves each batch to the "
            f"device, with pinned memory and non_blocking copies.")
    return None


def _clip_or_measure(params: list[nn.Parameter], max_norm: Optional[float]) -> torch.Tensor:
    """Clip to `max_norm` and return the pre-clip total norm; without clipping, only measure.

    Measuring never uses clip_grad_norm_(params, inf): with one inf gradient
    that turns every gradient into NaN.
    """
    if max_norm is None:
        return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def _check_optimizer_params(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    frozen = {id(p): name for name, p in model.named_parameters() if not p.requires_grad}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in frozen:
                raise SaferunError(
                    f"the optimizer holds frozen parameter '{frozen[id(p)]}'; weight decay or "
                    f"momentum would still move it. Build the optimizer from the params "
                    f"argument of build_optimizer(params), which excludes frozen parameters.")


class NonFiniteError(SaferunError):
    """NaN or Inf in the loss, the gradients or the parameters."""


def _short(items: Sequence[Any], limit: int = 16) -> str:
    shown = ", ".join(map(str, items[:limit]))
    return f"[{shown}{', ...' if len(items) > limit else ''}] ({len(items)} in all)"


def _take(iterator: Iterator[Any], n: int) -> list[Any]:
    group = []
    for batch in iterator:
        group.append(batch)
        if len(group) == n:
            break
    return group


def _resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """auto: CUDA if available, else CPU. Under torchrun, cuda means this rank's own GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"trainer.device: {e}. Use auto, cpu, cuda or cuda:N.") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device is cuda but no CUDA device is available; "
                          "use trainer.device=cpu or auto.")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    return device


def _root_cause(e: BaseException) -> str:
    while e.__cause__ is not None:
        e = e.__cause__
    return f"{type(e).__name__}: {e}"
