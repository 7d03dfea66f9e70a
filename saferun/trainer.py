"""The Trainer: owns the loop and applies the mode and gradient discipline.

Users subclass `Trainer` and override the task hooks (`build_model`,
`build_datasets`, `training_step`, `validation_step`, and optionally
`build_collate_fn`, `build_dataloaders`, `build_optimizer`, `build_scheduler`, `finish_validation`,
`after_fit`, `predict_step`, `test_step`, `batch_size`, `build_metrics`, `tokens_per_sample`). The loop itself (`fit`,
`train_step`, `validate`, `test`) is not an
override point; callbacks observe it (see `saferun.callbacks`).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
from pathlib import Path
from collections.abc import Mapping  # isinstance on it is twice as fast as on typing.Mapping
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from . import modes
from .callbacks import Callback, CallbackList, Control, StepOutput, TrainerView, _merge
from .checkpoint.checkpointer import Checkpointer, StatefulParts
from .checkpoint.compat import check_second_fit
from .checkpoint.rundir import default_run_dir, update_summary
from .checkpoint.store import LOCAL, Storage
from .config import Config, load_config
from .schedules import check_schedule_length
from .checkpoint.weights import Best, Weights, check_out_dir, find_weights, load_weights, saved_config
from .data import (check_datasets, check_evaluation_limit, check_training_loader,
                   evaluation_loader, loader_options, make_loaders, set_loader_epoch,
                   split_datasets)
from .errors import NonFiniteError, SaferunError  # noqa: F401  (saferun.trainer.NonFiniteError)
from .guards.badstep import BadStepPolicy
from .guards.policies import BadStep, Verdict
from .guards.replay import replay_bad_step
from .guards.datachecks import setup_warnings
from .diagnose.explain import StepContexts, explain_failure
from .guards.model_audit import FirstStepAudits, ModelAudit
from .guards.preflight import preflight
from .guards.step_guards import StepGuards
from .guards.trainable import TrainableSet
from .guards.unused import UnusedParameters, window
from .loggers import ensure_log_handler
from .loop.batches import BatchStream, first_batch
from .loop.evaluation import Evaluator
from .loop.logbook import EvalLog, Folded, Logbook
from .loop.habits import StepHabits, check_step_signatures, fit_arguments
from .loop.components import configured_callbacks, instantiate_node, required_node
from .loop.activation_checkpointing import apply_activation_checkpointing
from .loop.compile import check_compiled_step, unwrap_compiled
from .loop.frame import FirstBackward, StepFrame
from .loop.manual import ManualSteps, setup_optimizers
from .loop.metrics import RunningTrainMetrics
from .loop.optimizers import NamedOptimizers
from .loop.precision import autocast_factory, grad_scaler
from .data.seeding import derive_seed, seed_everything
from .loop.threads import apply_plan, busy_cores_elsewhere, plan_threads, usable_cores
from .loop.steptimer import StepTimer
from .loop.throughput import FlopCount, Throughput
from .data.transfer import batch_size_of, samples_in
from .loop import averaging, stateful
from .state import LoopState  # noqa: F401  (saferun.trainer.LoopState, as before)
from .loop.update import Gradients, OptimizerUpdate, ParamNorm, grad_accumulators
from .loop.steps import (accumulate, check_same_parameters, explained, loss_and_logs,
                         resolve_device, trainable_parameters)
from . import distributed
from .parallel.strategy import strategy_for
from .preemption import Preempted, StopRequested, StopSignals, stop_exit

log = logging.getLogger("saferun")


class Trainer:
    """Owns the training loop. Subclass it and override the task hooks.

    Args:
        cfg: a `Config`, a nested dict or an OmegaConf node; validated at once.
        callbacks: observers of the loop, called in list order.
        storage: where the checkpoints are kept (a `saferun.checkpoint.Storage`); default: the
            local filesystem (`LocalStorage`).
    """

    _schedule: Any  # Schedule or NamedSchedules: set with the optimizer (loop/manual.py)
    _check_first_batch: bool
    _samples_of: Optional[Callable[[Any], int]] = None  # fit(): batch_size_of, unless overridden

    def __init__(self, cfg: Config | Mapping[str, Any] | Any | None = None,
                 callbacks: Sequence[Callback] = (), storage: Optional[Storage] = None) -> None:
        self.cfg = load_config(cfg)
        # as given (a Config is resolved already): a second fit() resolves it with its limits
        self._given = None if cfg is None or isinstance(cfg, Config) else copy.deepcopy(cfg)
        self._built_config: dict[str, Any] = {}  # the config setup() built the run with
        self.ranks = distributed.ranks_from_env()
        self.device = resolve_device(self.cfg.trainer.device, self.ranks.local_rank)
        self.model: nn.Module = None  # type: ignore[assignment]  # built by setup()
        self.optimizer: torch.optim.Optimizer = None  # type: ignore[assignment]
        self.scheduler: Optional[torch.optim.lr_scheduler.LRScheduler] = None
        self.train_loader: Optional[DataLoader] = None
        self.val_loader: Optional[DataLoader] = None
        self.test_loader: Optional[DataLoader] = None  # while test() runs: the test data's loader
        self.state = LoopState(max_steps=self.cfg.trainer.max_steps,
                               config=dataclasses.asdict(self.cfg), rank=self.ranks.rank,
                               world_size=self.ranks.world_size)
        self.view = TrainerView(self.state)
        self._user_callbacks = list(callbacks)
        self._checkpointer = Checkpointer(self, self._stateful_parts, storage or LOCAL)
        self._fitted: Optional[tuple[Optional[int], Optional[int]]] = None  # limits of the last fit
        self._is_setup = False
        self._logbook = Logbook(self.ranks.is_main)  # what self.log() and log_image() collect
        self._manual: Optional[ManualSteps] = None  # several optimizers: their step (setup)
        self._tested: Optional[dict[str, Any]] = None  # from_run: the weights' provenance
        self._initial_said = False  # test()/predict() before training said so once

    # ------------------------------------------------------------------ task hooks

    def build_model(self) -> nn.Module:
        """Return the model. Default: instantiate the `model` config node."""
        return instantiate_node("model", required_node(self.cfg, "model", type(self).__name__,
                                                       "build_model"))

    def build_datasets(self) -> tuple[Dataset, Optional[Dataset]] | tuple[
            Dataset, Optional[Dataset], Optional[Dataset]]:
        """Return (train dataset, validation dataset or None), or (train, val, test): test()
        without data then uses the third. Default: the `data` node (a Dataset, or such a tuple)."""
        datasets = instantiate_node("data", required_node(self.cfg, "data", type(self).__name__,
                                                           "build_datasets"))
        return (datasets, None) if isinstance(datasets, Dataset) else tuple(datasets)

    def build_dataloaders(self, train: Dataset, val: Optional[Dataset]
                          ) -> tuple[DataLoader, Optional[DataLoader]]:
        """Return (train loader, val loader or None), seeded and pinned per the config."""
        data = self.data_ranks
        return make_loaders(train, val, self.cfg.trainer, self.cfg.seed, data.rank,
                            data.world_size, self._pin_memory(), self.build_collate_fn())

    @property
    def data_ranks(self) -> distributed.Ranks:
        """After setup's strategy: the ranks the data is split over, and this one's place among
        them (`.rank`, `.world_size`; `.group` for collectives): every rank under DDP and FSDP,
        the "dp_shard" dimension on a mesh. A build_dataloaders override splits by these."""
        return self._strategy.data

    def _pin_memory(self) -> bool:
        pin = self.cfg.trainer.pin_memory
        return self.device.type == "cuda" if pin is None else pin

    def build_collate_fn(self) -> Optional[Callable[[list[Any]], Any]]:
        """Return the function that turns a list of samples into a batch, used by the training,
        validation and predict loaders, or None for torch's default. Default: the `collate_fn`
        node. With workers it must pickle (a module-level function, or an instance of a
        module-level class): the preflight names what does not."""
        if self.cfg.collate_fn is None:
            return None
        return instantiate_node("collate_fn", self.cfg.collate_fn)

    def build_optimizer(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        """Return the optimizer over the trainable `params`. Default: the `optim` node."""
        return instantiate_node("optim", self.cfg.optim, params=params)

    def build_scheduler(self, optimizer: torch.optim.Optimizer
                        ) -> Optional[torch.optim.lr_scheduler.LRScheduler]:
        """Return an LR scheduler, or None. Default: the `sched` node. It is stepped once per
        optimizer step that ran; a ReduceLROnPlateau after each validation, with the metric
        trainer.sched_metric names."""
        if self.cfg.sched is None:
            return None
        return instantiate_node("sched", self.cfg.sched, optimizer=optimizer)

    def build_metrics(self) -> Mapping[str, Any]:
        """{name: torchmetrics.Metric}: validation_step updates self.metrics[name]; val/<name>."""
        return {k: instantiate_node(f"metrics.{k}", n) for k, n in (self.cfg.metrics or {}).items() if n}

    def parallelize(self, model: nn.Module, mesh: Any) -> nn.Module:
        """trainer.strategy=mesh: apply the model's parallel plan in place and return the model,
        e.g. `parallelize_module(model, mesh["tp"], {...})` (tensor parallel). Called once in
        setup on the built model, with a DeviceMesh of trainer.parallel's shape (dimensions
        "dp_shard", "tp"); FSDP2 then shards it over "dp_shard". Default: the model as is."""
        return model

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
        (on rank 0 under torchrun; on every rank with trainer.strategy=fsdp, whose forward
        needs them all): e.g. print a sample. Default: nothing."""

    def test_step(self, batch: Any) -> Mapping[str, torch.Tensor]:
        """Return a dict of scalar metrics for a test batch, as validation_step does (test/...).
        Default: validation_step."""
        return self.validation_step(batch)

    def predict_step(self, batch: Any) -> Any:
        """Return the model's output for `batch`. Default: model(batch), or model(batch[0])."""
        if isinstance(batch, (tuple, list)):
            return self.model(batch[0])
        return self.model(batch)

    def batch_size(self, batch: Any) -> int:
        """Samples in `batch`: the first dimension of its first tensor. Override if not."""
        return batch_size_of(batch)

    def tokens_per_sample(self) -> Optional[int]:
        """Tokens in one training sample (a language model's sequence length), for
        perf/tokens_per_sec; None (the default): the task has no tokens. Asked once, in setup,
        after the loaders are built."""
        return None

    # ------------------------------------------------------------------ the loop

    def setup(self) -> None:
        """Seed, then build the model, data, optimizer and scheduler (once)."""
        if self._is_setup:
            return
        t = self.cfg.trainer
        ensure_log_handler()
        self._built_config = dataclasses.asdict(self.cfg)
        distributed.start(self.ranks, self.device, t.collective_timeout)
        seed_everything(self.cfg.seed)  # the same on every rank: identical initial weights
        model = self.build_model()
        if not isinstance(model, nn.Module):
            raise SaferunError(f"build_model() returned {type(model).__name__}, not an nn.Module.")
        model = unwrap_compiled(model)
        self._frozen = modes.resolve_modules(model, t.frozen_modules)
        modes.freeze(self._frozen)
        self.model = model.to(self.device)
        apply_activation_checkpointing(self.model, t.activation_checkpointing)  # before fsdp shards
        self._strategy = strategy_for(t, self.ranks, self.device, self.state, self)
        self._strategy.prepare(self.model)  # before the optimizer: fsdp shards in place
        data = self._strategy.data  # the ranks the data is split over
        if data.world_size > 1:  # dropout etc. per data rank (a tensor-parallel group: one stream)
            seed_everything(derive_seed(self.cfg.seed, data.rank))
        train_set, val_set, self._test_set = split_datasets(self.build_datasets(), type(self).__name__)
        check_datasets(train_set, val_set, data.world_size)
        self.train_loader, self.val_loader = self.build_dataloaders(train_set, val_set)
        check_training_loader(self.train_loader, data.world_size)
        self._threads_unsaid: Optional[str] = self._plan_threads()
        check_evaluation_limit(self.val_loader, t, data.world_size)  # same samples on any
        setup_warnings(model, self._frozen, t, self.train_loader, data.world_size,
                       self.val_loader)
        self._params = trainable_parameters(model)
        self._built_with = {id(p) for p in model.parameters()}  # (a second fit(): still these)
        self.optimizer = self.build_optimizer(self._params)
        check_step_signatures(self)  # training_step(batch), not (batch, batch_idx)
        self._habits = StepHabits()  # no backward or optimizer step inside training_step
        self.optimizer, self.scheduler, self._schedule = setup_optimizers(self, model)
        several = isinstance(self.optimizer, NamedOptimizers)  # build_optimizer's {name: optimizer}
        self._habits.watch(self.optimizer.values() if several else [self.optimizer],  # type: ignore[attr-defined]  # several: a dict
                           self._schedule.schedulers())
        self._ema = averaging.weight_average(self.model, self.optimizer, t.ema)  # trainer.ema, or None
        self._scaler = grad_scaler(self.device, t.precision)
        self._autocast = autocast_factory(self.device, t.precision)
        self._non_blocking = self.device.type == "cuda"
        self.metrics = stateful.prepared_metrics(self.build_metrics(), self.device, self.cfg.metrics)
        self._evaluator = Evaluator(self.model, self.device, self._non_blocking, self._autocast,
                                    t.eval_grad_mode, self.cfg.guards.eval_purity, self.metrics,
                                    self._explain_failure, self.cfg.guards.declared_modes,
                                    self._strategy.after_evaluation, data.group)
        self.state.run_dir = t.run_dir or default_run_dir()
        self._callbacks = CallbackList(self._user_callbacks + configured_callbacks(
            self.cfg, self.ranks.is_main, self.device.type))
        self._running = RunningTrainMetrics()
        self._perf = Throughput(self.device, t.precision, self.tokens_per_sample(),
                                countable=not t.compile and not self._strategy.sharded,
                                say=self.ranks.is_main)
        self._stop_signals = StopSignals(t.stop_signals)
        self._setup_guards()
        self._batches = BatchStream(self.train_loader, t, self.cfg.seed, self.state,
                                    self._check_first_batch, data)
        self._guard = BadStepPolicy(self, self._running, self.train_loader, self._checkpointer.newest)
        if self._guard.spikes is not None and not self._guard.spikes_each_step:
            self._running.spike_flagger = self._guard.flag_steps  # compared at log points
        self._timer = StepTimer(self.device, t.log_every_n_steps, phases=not several)
        self._update = OptimizerUpdate(self._scaler, self._guard, t.max_grad_norm, self._timer)
        self._grads = Gradients(self._params, self._strategy.meshes)  # (checked at each step)
        if self.val_loader is not None and type(self).validation_step is Trainer.validation_step:
            self.validation_step(None)  # raises the "override validation_step" error now
        if t.compile:
            self.model.compile(backend=t.compile_backend)
        self._strategy.finish_setup(self.val_loader, several, self.train_loader, self.metrics)
        self._frame = StepFrame(self, logbook=self._logbook, habits=self._habits,
                                strategy=self._strategy, autocast=self._autocast,
                                device=self.device, non_blocking=self._non_blocking)
        self._guards = self._step_guards(several)
        self._manual = ManualSteps(  # several optimizers: the step training_step drives
            self, model, self._frame, self._update, schedule=self._schedule,
            guards=self._guards) if several else None
        self._checkpointer.find_resume()  # resume applies to every entry point: fit, validate, predict
        self._is_setup = True

    def _plan_threads(self) -> str:
        """trainer.num_threads: torch's threads for this process's share of the cores
        (loop/threads.py); returns the plan in words for `_say_threads`."""
        workers = getattr(self.train_loader, "num_workers", 0)
        plan = plan_threads(self.cfg.trainer.num_threads, os.environ, usable_cores(), workers,
                            torch.get_num_threads(), busy_cores_elsewhere)
        return apply_plan(plan)

    def _say_threads(self) -> None:
        """Say the threads plan once, when the run directory is this run's: a start refused
        there (another run's checkpoints) must write nothing into that run's saferun.log."""
        if self._threads_unsaid is not None and self.ranks.is_main:
            log.info("%s", self._threads_unsaid)
        self._threads_unsaid = None

    def _step_guards(self, several: bool) -> StepGuards:
        """The in-loop guards the config turns on, one line each (guards/step_guards.py)."""
        g, guards = self.cfg.guards, StepGuards()
        if self._guard.snapshot is not None:  # a skip policy: the buffers as before each step
            guards.register(self._guard.snapshot)
        if g.declared_modes:
            guards.register(modes.DeclaredModes(self.model, self._frozen))
        if g.unused_params and not several:  # (several optimizers: each optimize() watches its own)
            guards.register(UnusedParameters(self.model.named_parameters(),
                                             window(self.cfg.trainer.max_steps, self.state.step)))
        if g.check_params:
            guards.register(ParamNorm(self._params, self._strategy.meshes))
        self._trainable = TrainableSet(self.model, self._params, self.state,  # (always: unfrozen mid-run)
                                       self.optimizer.values() if several else [self.optimizer])  # type: ignore[attr-defined]  # several: a dict
        guards.register(self._trainable)
        return guards

    def _setup_guards(self) -> None:
        g = self.cfg.guards
        self._check_first_batch = False
        if g.preflight:
            preflight(self.train_loader, self.val_loader)
            self._check_first_batch = self.train_loader is not None and self.train_loader.num_workers > 0

    def fit(self, *misplaced: Any) -> dict[str, float]:
        """Train until `trainer.max_steps` or `trainer.max_epochs`, whichever comes first;
        return the final metrics. Called again after raising a limit, it continues from where
        the last fit() ended, as one longer run would; with nothing left to train it refuses.
        It takes no arguments: the model and data come from the build_* hooks."""
        self._setup_for_fit(misplaced)
        t, state, cbs, timer = self.cfg.trainer, self.state, self._callbacks, self._timer
        limit = self._check_limits()
        self._checkpointer.begin_run(self._save)
        self._say_threads()
        try:
            self._start_training()
            cbs.on_fit_start(self.view)
            with self._stop_signals:
                control = self._owed_step_end()  # resumed from a stop in validation
                # (no local name for the generator: a stop must close it, and its workers, at once)
                for micro_batches, epoch_end, where in (
                        () if control and control.stop else self._batches.groups()):
                    control = None
                    if micro_batches:  # (none: a stream ran out, ending the epoch after its last step)
                        output = self.train_step(micro_batches)
                        self._running.add(output, where, self._logbook.take_step())
                        control = cbs.on_train_step_end(self.view, output)
                        if control is not None:  # (under torchrun: agreed at the next log point)
                            control = self._strategy.agreement.rank_local(control)
                        if state.step % t.log_every_n_steps == 0:
                            control = _merge(control, self._log())
                    control = self._end_step(control, epoch_end, bool(micro_batches))
                    if (control and control.stop) or (state.step >= limit and self._last_log_point()):
                        break
                    if state.step == timer.before and not timer.on:  # the next step is timed
                        timer.start(state.step)  # from here: its wait for data
                self._end_of_loop()
            self._fitted = (t.max_steps, t.max_epochs)  # a second fit() must raise one
            cbs.on_fit_end(self.view, dict(state.metrics))
            if self.ranks.is_main or self._strategy.sharded:  # fsdp: a forward needs every rank
                self._after_fit(dict(state.metrics))
        except BaseException as exc:
            error = self._failure(exc)
            if error is exc:
                raise
            raise error from (None if isinstance(error, Preempted) else exc)
        finally:
            self._end_fit()
        return dict(state.metrics)

    def _end_fit(self) -> None:
        """However fit() ends: the checkpointer's run ends, and the gradient accumulators are
        let go (the garbage collector cannot see through them: a parameter's hook that refers
        to this Trainer would keep it alive for good)."""
        self._checkpointer.end_run()
        self._accumulators: list[Any] = []

    def _last_log_point(self) -> bool:
        """At the step limit: the log point of the steps since the last one, now. False if it
        rolled back (a spike or a NaN among them): the run trains on to the limit, as after a
        rollback at an earlier log point."""
        step = self.state.step
        if self._running.steps:
            self._log()
        return self.state.step == step

    def _end_of_loop(self) -> None:
        """After the last step: its log point, the final validation unless the loop has just
        validated these weights, and the final save. A run that ends before a bad step it
        rolled back from says so: nothing was left to train (the epochs' data had run out, or a
        callback asked to stop), so the run's last step is the checkpoint's."""
        if self._running.steps:
            self._log()
        if self._guard.rolled_back_from > self.state.step:
            log.warning("The run ends at step %d, the checkpoint it rolled back to from step %d: "
                        "nothing was left to train after it (the epochs' data had run out, or a "
                        "callback asked to stop).", self.state.step, self._guard.rolled_back_from)
        # (a validation that rolled back validated nothing, and the weights rolled back to are
        # validated now unless their checkpoint's step was)
        if self.state.validated_at != self.state.step:
            self._validate_and_report(Control(stop=True))  # the loop has ended
        # Always saved: the final validation may have changed callback state since the last save.
        step = self.state.step
        self._save()
        self._checkpointer.save_final(step, restore_best=any(
            getattr(cb, "restore_best", False) for cb in self._callbacks.callbacks))

    def _failure(self, exc: BaseException) -> BaseException:
        """What fit() raises for `exc`: the preemption exit (after the save), an explained
        error, or `exc` itself; the callbacks are told."""
        with self._stop_signals.while_stopping():  # the second Ctrl-C, during the save too
            error = (self._preempted(exc) or explained(exc, self.state.step + 1, self.model)
                     or self._explain_failure(exc)
                     or exc)
            self._callbacks.on_exception(self.view, error)
        return error

    def _explain_failure(self, exc: BaseException) -> Optional[BaseException]:
        """`exc` explained in the user's terms (diagnose/explain.py), or None; its replay runs
        the step as the loop does (autocast, the evaluation modes, several optimizers)."""
        return explain_failure(exc, self, StepContexts(self._autocast, self._evaluator.evaluating,
                                                       self._manual))

    def train_step(self, micro_batches: Sequence[Any]) -> StepOutput:
        """One optimizer step over `micro_batches`. Reads top to bottom."""
        timer = self._timer  # on the step of a log point, marks where its time went
        if timer.on:
            timer.lap("data_wait")
        if self._manual is not None:  # several optimizers: training_step calls optimize()
            return self._manual.step(micro_batches)
        guards = self._guards  # the in-loop guards the config turns on (setup)
        for before in guards.before_step:  # a skip policy: the buffers as before this step
            before()
        if timer.on:
            timer.lap("guards")
        loss, logs, samples = self._forward_backward(micro_batches)
        if timer.on:
            timer.lap("forward_backward")
        step = self.state.step + 1
        for check in guards.after_backward:  # declared modes; unused parameters (first steps)
            if check(step):
                guards.drop(check)  # done
        if timer.on:
            timer.lap("guards")
        grad_norm, skipped, spike, loss_spike = self._update(  # (a skip policy: one host sync)
            self.optimizer, self._grads, self._schedule, loss)
        if self._update.scaling:  # fp16: after the step (a skipped one too: it saw the gradients)
            self._scaler.update()
        if timer.on:
            timer.lap("optimizer")
        if skipped:
            return self._guard.skipped(loss, grad_norm, samples)
        self.state.advance(samples)
        return StepOutput(loss=loss, grad_norm=grad_norm, logs=logs, num_samples=samples,
                          spike=spike, loss_spike=loss_spike)

    def optimize(self, name: str, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """With several optimizers (`build_optimizer` returned {name: optimizer}), called in
        training_step once per optimizer, in the order the algorithm needs: backward `loss` into
        optimizer `name`'s parameters only and step it, with the loop's discipline (see
        loop/manual.py). `retain_graph=True` keeps the graph for a later optimize() whose loss
        shares it; autograd refuses that later backward if it needs a value this update changed
        (saferun marks the updated parameters changed, fused optimizers too)."""
        if self._manual is None:
            raise SaferunError(
                "self.optimize(name, loss) drives one of several named optimizers; this Trainer "
                "has one optimizer (or is not set up), which the loop steps itself from the loss "
                "that training_step returns. Return the loss, or return {name: optimizer} from "
                "build_optimizer.")
        self._manual.optimize(name, loss, retain_graph)

    def forward_only(self, batch: Any) -> Any:
        """training_step(batch) for its forward alone, as `saferun check` runs it: with several
        optimizers its self.optimize() calls update nothing (no backward, step or schedule);
        with one, training_step is called as it is. Returns what training_step returns."""
        if self._manual is None:
            return self.training_step(batch)
        with self._manual.replaying(False):
            return self.training_step(batch)

    def _forward_backward(self, micro_batches: Sequence[Any], share: float = 1.0,
                          last: bool = True, samples: int = 0
                          ) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
        """Forward and backward over the micro-batches: (mean loss, mean logs, samples). One
        (trainer.accumulate=1) runs here, in the step frame; several go through `accumulate`,
        which counts them and calls back for each with its samples, its share and whether it
        is the last."""
        if len(micro_batches) != 1:
            return accumulate(self._forward_backward, micro_batches, self.batch_size)
        if not samples:
            samples = (self._samples_of or self.batch_size)(micro_batches[0])
            if type(samples) is not int or samples <= 0:  # (samples_in: an int, or the message)
                samples = samples_in(micro_batches[0], self.batch_size, f"step {self.state.step + 1}")
        then = self._backward if share == 1.0 else (
            lambda out, step: self._backward(out, step, share))
        loss, logs = self._frame.run(micro_batches[0], last, then)
        return loss, logs, samples

    def _backward(self, out: Any, step: int, share: float = 1.0
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """After training_step, in the step frame (under the strategy's micro-batch context):
        the loss checked, weighted by its share of an accumulated step (so the sum is the whole
        batch's mean), and backpropagated (scaled under fp16)."""
        loss, logs = loss_and_logs(out, step)
        if share != 1.0:
            loss, logs = loss * share, {k: v * share for k, v in logs.items()}
        (self._scaler.scale(loss) if self._update.scaling else loss).backward()
        return loss.detach(), logs

    def validate(self) -> dict[str, float]:
        """Average `validation_step` over the validation set, in eval mode without autograd."""
        self.setup()
        self._checkpointer.check_evaluated_weights("validate")
        self._say_threads()
        if self.val_loader is None:
            return {}
        set_loader_epoch(self.val_loader, self.cfg.seed, 0, self._strategy.data.rank)
        stopped = lambda: self.ranks.world_size == 1 and self._stop_signals.received is not None  # noqa: E731
        self._logbook.take()  # (media of a validate() outside fit, never written: not these)
        metrics = averaging.validate_both(self, self._ema, self._evaluator, lambda e: self.finish_validation(
            self._validation_pass(e, stopped)))
        self.state.metrics.update(metrics)
        return metrics

    def _validation_pass(self, evaluator: Evaluator, stopped: Callable[[], bool],
                         phase: str = "val", loader: Optional[DataLoader] = None) -> dict[str, float]:
        """One pass of validate() (`phase` "val") or test() ("test", over `loader`): the step
        over the loader with what it self.log()s, then (validation of the raw weights) the
        callbacks' on_evaluate, reduced with it."""
        folded, raw, val = Folded(), evaluator is self._evaluator, phase == "val"
        step_fn = self._logbook.validation_step(self.validation_step if val else self.test_step,
                                                phase if raw else f"{phase}_ema", folded)

        def finish() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
            self._logbook.begin(phase, 0)
            if raw and val:
                self._callbacks.on_evaluate(self.view, self.model, EvalLog(self._logbook),
                                            self.ranks.is_main, self._strategy.sharded)
            means = self._logbook.joined({}, "on_evaluate")
            folded.merge(self._logbook.take_folded())
            return means, folded.reduced(self.device, self._strategy.data.group)

        return evaluator.validate(self.val_loader if val else loader, step_fn,  # type: ignore[arg-type]  # validation needs a val_loader
                                  self.batch_size,
                                  self.cfg.trainer.limit_val_batches if val else None, stopped,
                                  self.state.step, finish, "validation_step" if val else "test_step")

    def test(self, data: Dataset | DataLoader | None = None) -> dict[str, float]:
        """Average `test_step` over `data` (a Dataset or DataLoader; None: the third set
        build_datasets returned) as validate() does: eval mode, inference_mode, the purity
        guard, synced over the ranks. Returns test/... metrics and reports them (on_test_end:
        metrics.jsonl, TensorBoard, the log; summary.json in the run directory)."""
        self.setup()
        self._checkpointer.check_evaluated_weights("test")
        self._say_threads()
        self._say_if_initial_weights("test")
        self.test_loader = loader = self._test_loader(data)
        self._logbook.take()  # (what an earlier pass left: not this one's)
        try:
            metrics = {f"test/{k}": v for k, v in self.finish_validation(self._validation_pass(
                self._evaluator, lambda: False, "test", loader)).items()}
        finally:
            self.test_loader = None
        if self._tested is not None and self.ranks.is_main:
            log.info("test: the weights of %s (%s, step %s, epoch %s, sha256 %s).",
                     self._tested["run"], self._tested["checkpoint"], self._tested["step"],
                     self._tested["epoch"], self._tested["sha256"])
        self._callbacks.on_test_end(self.view, metrics)
        self._write_media(self._logbook.take()[1])
        if self.ranks.is_main:
            # from_run: which weights of which run these metrics are of
            tested = {"tested": self._tested} if self._tested is not None else {}
            update_summary(self.state.run_dir, {"test": metrics, "test_at_step": self.state.step,
                                                **tested})
        return metrics

    def _setup_for_fit(self, misplaced: Sequence[Any]) -> None:
        if misplaced:  # trainer.fit(model, loader), Lightning's habit: before anything is built
            raise fit_arguments(self, misplaced)
        self.setup()
        if not self._strategy.sharded:  # (fsdp swaps the parameters it gathers)
            check_same_parameters(self.model, self._built_with)

    def _after_fit(self, metrics: dict[str, float]) -> None:
        self._logbook.closed = "after_fit"  # after the last log point: logging is refused there
        try:
            self.after_fit(metrics)
        finally:
            self._logbook.closed = None

    def _say_if_initial_weights(self, entry: str) -> None:
        """test()/predict() before any training and with no weights loaded: say once that the
        numbers are those of the initial weights (a run's checkpoints: the checkpointer says)."""
        if self._initial_said or self._tested is not None or self.state.step or self.cfg.resume \
                or not self.ranks.is_main or self._checkpointer.list():
            return
        self._initial_said = True
        name = type(self).__name__
        log.warning("%s(): %s has not trained and loaded no weights, so this evaluates its initial "
                    "weights (step 0), unless you loaded others into self.model. Call fit() first, "
                    "or evaluate a run's weights with %s.from_run(run_dir) (saferun test RUN_DIR).",
                    entry, name, name)

    def _test_loader(self, data: Dataset | DataLoader | None) -> DataLoader:
        if isinstance(data, DataLoader):
            return data
        if data is None and self._test_set is None:
            raise SaferunError(
                f"test() was given no data and {type(self).__name__}.build_datasets() returned "
                f"no test set. Pass the test set, trainer.test(dataset_or_loader), or return "
                f"(train, val, test) from build_datasets (on the command line: a data node "
                f"whose datasets include a test split).")
        t, dataset = self.cfg.trainer, self._test_set if data is None else data
        assert dataset is not None  # (refused above)
        return evaluation_loader(dataset, t, None, **loader_options(
            t, self.cfg.seed, self._strategy.data.rank, self._strategy.data.world_size, self._pin_memory(),
            self.build_collate_fn()))

    def predict(self, data: Dataset | DataLoader) -> Any:
        """Run `predict_step` over `data` in eval mode without autograd; outputs on the CPU.

        Tensors are concatenated along the batch dimension; other outputs come back as a list
        (one entry per batch) with every tensor inside on the CPU, usable in autograd.
        """
        self.setup()
        self._checkpointer.check_evaluated_weights("predict")
        self._say_threads()
        self._say_if_initial_weights("predict")
        loader = data if isinstance(data, DataLoader) else DataLoader(
            data, batch_size=self.cfg.trainer.val_batch_size or self.cfg.trainer.batch_size,
            collate_fn=self.build_collate_fn())
        return self._evaluator.predict(loader, self.predict_step, self.state.step)

    # ------------------------------------------------------------------ loop helpers

    def _start_training(self) -> None:
        """Train mode for everything except frozen modules; say so if the model was in eval."""
        modes.start_training(self.model, self._frozen, self.cfg.trainer.frozen_modules)
        if self.cfg.trainer.compile:
            self._check_compile()
        if self._guard.needs_checkpoint:  # a rollback or an anomaly replay
            self._checkpointer.ensure_one(self._save)  # so there is always a good state to go back to
        # the first steps' checks, run by the step frame (free once done)
        audits = [FirstStepAudits(self._model_audit(), not self.cfg.trainer.compile,
                                  lambda: vars(self))] if self.cfg.guards.model_audit else []
        first = [] if self._manual is not None else [FirstBackward(self._habits, self._params)]
        self._frame.first_steps(*first, *audits)
        self._frame.count_first_step(FlopCount(self._perf) if self._perf.counting else None)
        self._timer.plan(self.state.step, self.state.max_steps, starting=True)  # (perf/*_ms)
        self._guard.rolled_back_from = 0  # (a second fit(): the first's rollback is not this one's)
        self._trainable.begin()  # the optimizer state held as this fit starts (a resume's too)
        # each parameter's gradient accumulator, held from here on (why: loop/update.py)
        self._accumulators = grad_accumulators(self._params)
        # a batch's samples: batch_size_of itself, without the call through the hook that only
        # forwards to it, unless batch_size is overridden
        default = type(self).batch_size is Trainer.batch_size and "batch_size" not in vars(self)
        self._samples_of = batch_size_of if default else None

    def _model_audit(self) -> ModelAudit:
        """guards.model_audit's state audit, set up (its warnings said) for this fit's first steps."""
        audit = ModelAudit(self.model, self._params, check_new_params=not self._strategy.sharded)
        audit.at_setup()
        return audit

    def _check_limits(self) -> float:
        """The step limit of this fit(). A second fit() must have something left to train (else
        it would return the same metrics, silently); the run's planned length for the progress
        bar; and a warning when max_steps ends the run before max_epochs (a recipe's max_steps
        under a max_epochs given on the command line)."""
        t, state = self.cfg.trainer, self.state
        if self._checkpointer.restored_best:
            raise SaferunError(
                f"fit() already ran on this Trainer and EarlyStopping(restore_best=True) put the "
                f"best weights (step {self.best.step if self.best else '?'}) back into the model, "
                f"while the optimizer and schedule are those of step {state.step}: training on "
                f"would mix the two. To continue the run, build a new Trainer with resume= the "
                f"checkpoint to continue from (the best: {self.best.checkpoint if self.best else '?'}).")
        done = (t.max_steps is not None and state.step >= t.max_steps) or (
            t.max_epochs is not None and state.epoch >= t.max_epochs)
        if self._fitted is not None and (done or self._fitted == (t.max_steps, t.max_epochs)):
            raise SaferunError(
                f"fit() already ran on this Trainer and ended at step {state.step}, epoch "
                f"{state.epoch} (trainer.max_steps={t.max_steps}, trainer.max_epochs="
                f"{t.max_epochs}): called again it would train nothing and return the same "
                f"metrics. To train further, raise a limit first (e.g. "
                f"trainer.cfg.trainer.max_steps = {2 * state.step}), then call fit(): it "
                f"continues from step {state.step} as one longer run would. For a new run, build "
                f"a new Trainer.")
        if self._fitted is not None:  # what the run was built with must still hold
            found = self._checkpointer.list()
            check_second_fit(self._given, self._built_config, dataclasses.asdict(self.cfg),
                             state.step, found[-1] if found else None)
        per_epoch = self._batches.steps_per_epoch()
        by_epochs = None if t.max_epochs is None or per_epoch is None else t.max_epochs * per_epoch
        state.max_steps = t.max_steps if t.max_steps is not None else by_epochs
        check_schedule_length(self.scheduler, state.max_steps)  # OneCycleLR: before any step
        if (by_epochs is not None and t.max_steps is not None and t.max_steps < by_epochs
                and self._fitted is None and self.ranks.is_main):
            log.warning("trainer.max_steps=%d ends this run after %.3g of the trainer.max_epochs=%d "
                        "epochs (%d steps each). To train every epoch, set trainer.max_steps=null "
                        "(max_epochs alone then ends the run) or at least %d.", t.max_steps,
                        t.max_steps / per_epoch, t.max_epochs, per_epoch, by_epochs)  # type: ignore[operator]  # by_epochs: per_epoch set
        return math.inf if t.max_steps is None else t.max_steps

    def _check_compile(self) -> None:
        """Compiled against eager on the first training batch (see `check_compiled_step`)."""
        assert self.train_loader is not None
        batch = first_batch(self.train_loader, self.cfg.seed, self._strategy.data.rank, self.device,
                            self._non_blocking)
        check_compiled_step(self.training_step, batch, self.model, self._frozen,
                            self._evaluator.evaluating,
                            self._autocast, self.cfg.trainer.compile_rtol, self.cfg.trainer.compile_atol)

    def _validate_and_report(self, pending: Optional[Control] = None) -> Optional[Control]:
        """Validate and tell the callbacks. `pending`: what the step still has to do after
        validation; a stop during validation saves it with the checkpoint, as owed."""
        if not self._window_good():
            return None  # rolled back: the state this validation was for is gone
        state = self.state
        state.owed = {"step": state.step, "save": bool(pending and pending.save),
                      "stop": bool(pending and pending.stop)}
        metrics = self.validate()
        state.owed, state.validated_at = None, state.step
        if not metrics:
            return None
        self._schedule.after_validation(metrics)  # a ReduceLROnPlateau, with trainer.sched_metric
        control = self._strategy.agreement.agreed(self._callbacks.on_validation_end(self.view, metrics))
        self._write_media(self._logbook.take()[1])
        best = self._checkpointer.new_best(metrics)  # trainer.save_best: improved?
        if best is not None:
            self._checkpointer.best_saved(self._save(best))
        return control

    def _end_step(self, control: Optional[Control], epoch_end: bool, stepped: bool = True
                  ) -> Optional[Control]:
        """The rest of a step after its log point: validation (if due or asked), a save (if
        due or asked), and a stop on a signal, raised here, at the step boundary. `epoch_end`:
        the step ended its epoch (validation is due then, without trainer.val_every_n_steps);
        `stepped`: False at a stream's end, after its last step, whose due save is made."""
        state, t = self.state, self.cfg.trainer
        every, save_every = t.val_every_n_steps, t.save_every_n_steps
        # (not due for the weights of a checkpoint that a rollback went back to: validated)
        due = self.val_loader is not None and state.validated_at != state.step and (
            epoch_end if every is None else state.step % every == 0)
        if due or (control and control.evaluate):
            control = _merge(control, self._validate_and_report(control))
        if (control and control.save) or (
                stepped and save_every is not None and state.step % save_every == 0):
            self._save()
        if self._strategy.agreement.stop_agreed(self._stop_signals):
            raise StopRequested
        return control

    def _owed_step_end(self) -> Optional[Control]:
        """Resumed from a checkpoint saved when a stop interrupted a validation: end that
        step as the uninterrupted run did (validate, callbacks, save, stop). Returns the
        step's control."""
        owed, self.state.owed = self.state.owed, None
        if owed is None or owed["step"] != self.state.step:
            return None  # (a checkpoint of a finished run: its final validation is done)
        log.info("Resumed from a stop during validation at step %d: validating first.",
                 self.state.step)
        return self._end_step(Control(evaluate=True, save=owed["save"], stop=owed["stop"]),
                              epoch_end=False)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The whole training state: what `load_state_dict` needs to continue exactly.

        Under torchrun every rank must call it (it gathers each rank's RNG states and
        pending metrics onto rank 0); on the other ranks `per_rank` is None.
        """
        assert self.train_loader is not None
        return self._checkpointer.assemble()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()`'s result. RNG states apply when training resumes."""
        self.setup()
        self._checkpointer.restore(state)

    def _save(self, best: Optional[float] = None) -> Path:
        """A checkpoint of this step (`best`: save_best's new best, with that value), once the
        steps since the last check and the state it would write are good: a checkpoint is
        always a good state to resume or roll back to. If they are not, nothing is saved: the
        policy's verdict is applied (raise, or roll back: the newest checkpoint is returned)."""
        guard, checkpointer = self._guard, self._checkpointer
        # nor a non-finite parameter, buffer or optimizer state (an update under a finite loss)
        bad = guard.window_bad() or guard.state_bad(checkpointer.path())
        if bad is not None:
            self._bad_window(bad)  # raises, or rolls back
            return checkpointer.list()[-1]  # rolled back to it (this step has no checkpoint)
        return checkpointer.save(best)

    def _window_good(self) -> bool:
        """Were the steps since the last check good? If not, the policy's verdict is applied
        (raise, or roll back: False)."""
        bad = self._guard.window_bad()
        if bad is not None:
            self._bad_window(bad)
        return bad is None

    def _bad_window(self, bad: BadStep) -> None:
        """A check found `bad`: apply its policy's verdict. Raise the guard's error (with
        guards.anomaly_replay, after a replay of the bad step), or roll back to the newest
        clean checkpoint and go on with the data after the bad step."""
        guard = self._guard
        if guard.verdict(bad) is Verdict.ROLL_BACK:
            guard.rolling_back(bad)  # (too many in a row raise)
            path, skipped = self._checkpointer.roll_back(guard.unclean)
            guard.rolled_back(bad, path, skipped)  # said (none clean: raises)
            return
        replayed = replay_bad_step(bad.step, self._checkpointer, self._running, self._batches,
                                   self.state, self.train_step, self._forward_backward,
                                   self.model) if guard.replays(bad) else ""
        raise guard.error(bad, replayed)

    def _stateful_parts(self) -> StatefulParts:
        """The parts whose state a checkpoint holds, as they are now (the Checkpointer asks
        for them at each save and restore; it never reads the Trainer's own attributes)."""
        return StatefulParts(
            model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
            scaler=self._scaler, ema=self._ema, running=self._running,
            spikes=self._guard.spikes, batches=self._batches, callbacks=self._callbacks,
            strategy=self._strategy, stop_signals=self._stop_signals)

    # ------------------------------------------------------------------ stop, log

    def _preempted(self, exc: BaseException) -> Optional[BaseException]:
        """After SIGTERM/SIGINT: save this step boundary and build the exit, else None
        (see `preemption.stop_exit`)."""
        return stop_exit(exc, self._stop_signals, self.ranks.world_size == 1,
                         self._batches.mid_step, self._save, self._checkpointer.newest, self.state.step,
                         self.state.run_dir, self.state.owed is not None)

    def _log(self) -> Optional[Control]:
        extra: dict[str, torch.Tensor] = {}
        for add in self._guards.at_log_point:  # guards.check_params: train/param_norm
            add(extra)
        agreement, signals = self._strategy.agreement, self._stop_signals
        metrics = self._running.read(extra, agreement.stop_votes(signals), self._strategy.data)
        agreement.count_stop_votes(metrics, signals)
        media = self._running.media
        bad = self._guard.log_point_bad(metrics)
        if bad is not None:
            self._bad_window(bad)  # raises, or rolls back (the window's metrics are then moot)
            return None
        self._running.reset()
        self._guard.clean_log_point()
        metrics.update(self._schedule.rates())  # the rates the latest step used, every group
        self._perf.at_log_point(metrics)  # perf/tokens_per_sec, perf/flops_per_step, perf/mfu
        self._timer.at_log_point(metrics, self.state.step)  # perf/*_ms: where a step's time went
        self.state.metrics.update(metrics)
        control = agreement.agreed(self._callbacks.on_log(self.view, metrics))
        self._write_media(media)
        return control

    def _write_media(self, media: list[Any]) -> None:
        """Images, histograms and texts logged since the last log point or in this validation:
        to the loggers (rank 0), at this step."""
        if media:
            self._callbacks.on_media(self.view, [m.at(self.state.step) for m in media])

    @property
    def scaler(self) -> torch.amp.GradScaler:
        """The GradScaler the update steps through: active under trainer.precision=fp16, a
        pass-through otherwise (after setup)."""
        self._require_setup("scaler")
        return self._scaler

    @property
    def ema(self) -> Optional[averaging.Average]:
        """trainer.ema's average of the weights (its `.module` holds them, but not when sharded
        under fsdp or a mesh; `state_dict()`), after setup; None when trainer.ema is off."""
        self._require_setup("ema")
        return self._ema

    @property
    def callbacks(self) -> tuple[Callback, ...]:
        """The callbacks fit() calls, in order: those passed to the Trainer, then the config's
        callbacks and loggers (after setup)."""
        self._require_setup("callbacks")
        return tuple(self._callbacks.callbacks)

    def _require_setup(self, name: str) -> None:
        if not self._is_setup:
            raise SaferunError(f"Trainer.{name} is built by setup(): call trainer.setup() first "
                               f"(fit(), validate(), test() and predict() call it).")

    @property
    def best(self) -> Optional[Best]:
        """trainer.save_best's best validation so far (metric, value, step, path of
        model_best.pt, its checkpoint), kept across a resume; None without save_best or
        before a finite value."""
        return self._checkpointer.best_record()

    @classmethod
    def from_run(cls, run_dir: str, checkpoint: str = "best", *, out_dir: Optional[str] = None,
                 callbacks: Sequence[Callback] = (), **kwargs: Any) -> "Trainer":
        """A set-up Trainer of this class, built from the config `run_dir` saved (config.yaml),
        with the weights `checkpoint` names: "best" (model_best.pt; with trainer.ema also
        model_ema_best.pt), "last" (model.pt), a checkpoint directory or a .pt file. Ready for
        validate(), predict() and test(). It never writes into `run_dir`: its own run
        directory is `out_dir`, or a new one under runs/, written only by test()."""
        config = saved_config(run_dir)
        weights = find_weights(run_dir, checkpoint, config, kwargs.get("storage") or LOCAL)
        check_out_dir(run_dir, out_dir)  # test() writes there: never into a run's own logs
        config["trainer"] = {**config["trainer"], "run_dir": out_dir}
        config["resume"] = None  # the weights are loaded below; nothing of the run resumed
        strategy = config["trainer"].get("strategy")
        if strategy in ("fsdp", "mesh"):  # sharded or split: the exported weights are whole
            if distributed.ranks_from_env().world_size > 1:
                raise SaferunError(
                    f"from_run({run_dir!r}) under torchrun with trainer.strategy={strategy}: the "
                    f"exported weights are whole; evaluate them in one process (it builds the "
                    f"model unsharded).")
            config["trainer"]["strategy"] = "auto"  # whole weights, one process: no sharding
        trainer = cls(config, callbacks, **kwargs)
        trainer.setup()
        trainer._load_exported(weights)
        trainer._tested = weights.provenance(run_dir)  # what test() records it evaluated
        return trainer

    def _load_exported(self, weights: Weights) -> None:
        """from_run: `weights` into the model (and trainer.ema's average); the step they are
        from, so what test() reports is at that step."""
        if weights.state is not None:  # a checkpoint directory: its model and average
            self._checkpointer.load_weights(weights.source, weights.state)
        else:
            load_weights(self.model, weights.model, weights.source)
            if self._ema is not None and weights.ema is not None:
                load_weights(self._ema.module, weights.ema, weights.source.with_name(
                    weights.source.name.replace("model", "model_ema", 1)))
            elif self._ema is not None:  # no average kept: val_ema/ would be the raw weights
                self._ema.load_state_dict(None)
        self.state.step = weights.step or 0
        self.state.epoch = weights.epoch or 0

    # ------------------------------------------------------------------ logging API

    @property
    def step(self) -> int:
        """The step being computed, as the logs count it: in training_step of the first step,
        1; everywhere else (validation_step, after_fit, callbacks) the steps taken so far."""
        return self.state.step + (self._logbook.phase == "train")

    @property
    def epoch(self) -> int:
        """The epoch being computed (0-based), as metrics.jsonl records it."""
        return self.state.epoch

    def log(self, name: str, value: torch.Tensor | float, reduce: str = "mean", **lightning: Any) -> None:
        """Log a scalar from training_step (as train/<name>) or validation_step (val/<name>),
        reduced over the log window (or the validation set) and the ranks with `reduce`:
        "mean" (as a returned value: weighted by samples), "last", "min", "max" or "sum".
        No host read: it is read with the other metrics at the log point."""
        self._logbook.log(name, value, reduce, lightning)

    def log_image(self, name: str, image: torch.Tensor | Any) -> None:
        """Log an image (C, H, W) or (H, W), values in [0, 1]: written at the next log point
        or validation end, on rank 0, to TensorBoard and the trackers."""
        self._logbook.log_media("image", name, image)

    def log_histogram(self, name: str, values: torch.Tensor | Any) -> None:
        """Log the distribution of `values` (any shape), written as log_image is."""
        self._logbook.log_media("histogram", name, values)

    def log_text(self, name: str, text: str) -> None:
        """Log a text (Markdown in TensorBoard), written as log_image is."""
        self._logbook.log_media("text", name, text)
