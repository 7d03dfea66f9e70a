"""The Trainer: owns the loop and applies the mode and gradient discipline.

Users subclass `Trainer` and override the task hooks (`build_model`,
`build_datasets`, `training_step`, `validation_step`, and optionally
`build_dataloaders`, `build_optimizer`, `build_scheduler`, `predict_step`,
`batch_size`). The loop itself (`fit`, `train_step`, `validate`) is not an
override point; callbacks observe it (see `saferun.callbacks`).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from . import modes
from .callbacks import Callback, CallbackList, Control, StepOutput, TrainerView, _merge
from .compile import check_compiled, unwrap_compiled
from .config import Config, load_config
from .data import batch_size_of, check_dataset, make_loader, move_to_device, set_loader_epoch
from .errors import ConfigError, SaferunError
from .loggers import LogLines, ProgressBar, ensure_log_handler, want_progress_bar
from .metrics import RunningTrainMetrics, WeightedMeans, scalar_dict
from .precision import autocast_factory, grad_scaler
from .seeding import preserved_rng, seed_everything

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
        self.device = _resolve_device(self.cfg.trainer.device)
        self.model: nn.Module = None  # type: ignore[assignment]  # built by setup()
        self.optimizer: torch.optim.Optimizer = None  # type: ignore[assignment]
        self.scheduler: Optional[torch.optim.lr_scheduler.LRScheduler] = None
        self.train_loader: Optional[DataLoader] = None
        self.val_loader: Optional[DataLoader] = None
        self.state = LoopState(max_steps=self.cfg.trainer.max_steps,
                               config=dataclasses.asdict(self.cfg))
        self.view = TrainerView(self.state)
        self._user_callbacks = list(callbacks)
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
                      pin_memory=self._pin_memory(), multiprocessing_context=t.multiprocessing_context)
        train_loader = make_loader(train, batch_size=t.batch_size, shuffle=t.shuffle,
                                   drop_last=t.drop_last, **common)
        val_loader = None
        if val is not None:
            val_loader = make_loader(val, batch_size=t.val_batch_size or t.batch_size,
                                     shuffle=False, drop_last=False, **common)
        return train_loader, val_loader

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
        """Return an LR scheduler stepped once per optimizer step, or None. Default: `sched`."""
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
        seed_everything(self.cfg.seed)
        model = self.build_model()
        if not isinstance(model, nn.Module):
            raise SaferunError(f"build_model() returned {type(model).__name__}, not an nn.Module.")
        model = unwrap_compiled(model)
        self._frozen = modes.resolve_modules(model, t.frozen_modules)
        modes.freeze(self._frozen)
        self.model = model.to(self.device)
        train_set, val_set = self.build_datasets()
        check_dataset(train_set, "training")
        if val_set is not None:
            check_dataset(val_set, "validation")
        self.train_loader, self.val_loader = self.build_dataloaders(train_set, val_set)
        self._params = [p for p in model.parameters() if p.requires_grad]
        if not self._params:
            raise SaferunError("the model has no trainable parameters (all are frozen or have "
                               "requires_grad=False). Check trainer.frozen_modules.")
        self.optimizer = self.build_optimizer(self._params)
        _check_optimizer_params(self.optimizer, model)
        self.scheduler = self.build_scheduler(self.optimizer)
        self._scaler = grad_scaler(self.device, t.precision)
        self._autocast = autocast_factory(self.device, t.precision)
        self._non_blocking = self.device.type == "cuda"
        self.state.run_dir = t.run_dir or os.path.join(
            "runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
        self._callbacks = CallbackList(self._user_callbacks + self._configured_callbacks())
        if self.val_loader is not None and type(self).validation_step is Trainer.validation_step:
            self.validation_step(None)  # raises the "override validation_step" error now
        if t.compile:
            self.model.compile(backend=t.compile_backend)
        self._is_setup = True

    def fit(self) -> dict[str, float]:
        """Train for `trainer.max_steps` steps; return the final metrics."""
        self.setup()
        t, state, cbs = self.cfg.trainer, self.state, self._callbacks
        self._start_training()
        running = RunningTrainMetrics()
        cbs.on_fit_start(self.view)
        try:
            validated = False
            for micro_batches, epoch_end in self._batch_groups():
                output = self.train_step(micro_batches)
                running.add(output)
                control = cbs.on_train_step_end(self.view, output)
                if state.step % t.log_every_n_steps == 0:
                    control = _merge(control, self._log(running))
                validated = bool(control and control.evaluate) or self._validation_due(epoch_end)
                if validated:
                    control = _merge(control, self._validate_and_report())
                if (control and control.stop) or state.step >= t.max_steps:
                    break
            if running.steps:
                self._log(running)
            if not validated:
                self._validate_and_report()
            cbs.on_fit_end(self.view, dict(state.metrics))
        except BaseException as exc:
            cbs.on_exception(self.view, exc)
            _raise_explained(exc, state.step)
            raise
        return dict(state.metrics)

    def train_step(self, micro_batches: Sequence[Any]) -> StepOutput:
        """One optimizer step over `micro_batches`. Reads top to bottom."""
        model, opt, scaler = self.model, self.optimizer, self._scaler
        sizes = [self.batch_size(b) for b in micro_batches]
        total = sum(sizes)
        loss_sum: Optional[torch.Tensor] = None
        logs_sum: dict[str, torch.Tensor] = {}
        for batch, size in zip(micro_batches, sizes):
            batch = move_to_device(batch, self.device, self._non_blocking)
            with self._autocast():
                loss, logs = _loss_and_logs(self.training_step(batch), self.state.step)
            # Weight each micro-batch by its share of the samples, so that the
            # accumulated gradient equals the gradient of the whole batch's mean loss.
            if size != total:
                loss, logs = loss * (size / total), {k: v * (size / total) for k, v in logs.items()}
            scaler.scale(loss).backward()
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
            for k, v in logs.items():
                logs_sum[k] = logs_sum[k] + v if k in logs_sum else v
        scaler.unscale_(opt)  # clip and measure the true gradients, not the fp16-scaled ones
        grad_norm = _clip_or_measure(self._params, self.cfg.trainer.max_grad_norm)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        self.state.step += 1
        self.state.samples_seen += total
        assert loss_sum is not None
        return StepOutput(loss=loss_sum, grad_norm=grad_norm, logs=logs_sum, num_samples=total)

    def validate(self) -> dict[str, float]:
        """Average `validation_step` over the validation set, in eval mode without autograd."""
        self.setup()
        if self.val_loader is None:
            return {}
        limit = self.cfg.trainer.limit_val_batches
        means = WeightedMeans()
        set_loader_epoch(self.val_loader, self.cfg.seed, 0, self.state.rank)
        with modes.evaluating(self.model, self.cfg.trainer.eval_grad_mode), self._autocast():
            for i, batch in enumerate(self.val_loader):
                if limit is not None and i >= limit:
                    break
                out = self.validation_step(move_to_device(batch, self.device, self._non_blocking))
                means.add(scalar_dict(out, "validation_step"), self.batch_size(batch))
        metrics = {f"val/{k}": v for k, v in means.read().items()}
        self.state.metrics.update(metrics)
        return metrics

    def predict(self, data: Dataset | DataLoader) -> Any:
        """Run `predict_step` over `data` in eval mode without autograd; outputs on the CPU.

        Tensors are concatenated along the batch dimension; other outputs come back as a list.
        """
        self.setup()
        loader = data if isinstance(data, DataLoader) else DataLoader(
            data, batch_size=self.cfg.trainer.val_batch_size or self.cfg.trainer.batch_size)
        outputs = []
        with modes.evaluating(self.model, self.cfg.trainer.eval_grad_mode), self._autocast():
            for batch in loader:
                outputs.append(self.predict_step(move_to_device(batch, self.device,
                                                                self._non_blocking)))
        # Outside inference mode, cat/clone turn inference tensors into normal ones,
        # which the caller may later use in autograd.
        if outputs and all(isinstance(o, torch.Tensor) for o in outputs):
            return torch.cat(outputs).cpu()
        return [move_to_device(o, torch.device("cpu")) for o in outputs]

    # ------------------------------------------------------------------ loop helpers

    def _batch_groups(self) -> Iterator[tuple[list[Any], bool]]:
        """Yield (micro-batches of one step, is this the epoch's last step) across epochs."""
        t, state = self.cfg.trainer, self.state
        loader = self.train_loader
        assert loader is not None
        while t.max_epochs is None or state.epoch < t.max_epochs:
            set_loader_epoch(loader, self.cfg.seed, state.epoch, state.rank)
            batches = iter(loader)
            group = _take(batches, t.accumulate)
            if not group and state.batches_in_epoch == 0:
                raise SaferunError(
                    f"the training DataLoader yielded no batches in epoch {state.epoch}. With "
                    f"drop_last=True it needs at least batch_size={t.batch_size} samples.")
            while group:
                following = _take(batches, t.accumulate)
                state.batches_in_epoch += len(group)
                yield group, not following
                group = following
            state.epoch += 1
            state.batches_in_epoch = 0

    def _start_training(self) -> None:
        """Train mode for everything except frozen modules; say so if the model was in eval."""
        if modes.set_train_modes(self.model, self._frozen):
            frozen = ", ".join(self.cfg.trainer.frozen_modules) or "none declared"
            log.info("The model was in eval mode (as pretrained loaders often return it); "
                     "saferun put it in train mode. Frozen modules kept in eval: %s.", frozen)
        if self.cfg.trainer.compile:
            self._check_compile()

    def _check_compile(self) -> None:
        assert self.train_loader is not None
        with preserved_rng():
            set_loader_epoch(self.train_loader, self.cfg.seed, 0, self.state.rank)
            batch = move_to_device(next(iter(self.train_loader)), self.device, self._non_blocking)

            def first_loss() -> torch.Tensor:
                with modes.evaluating(self.model, self.cfg.trainer.eval_grad_mode), self._autocast():
                    return _loss_and_logs(self.training_step(batch), 0, need_grad=False)[0]

            check_compiled(first_loss, self.cfg.trainer.compile_rtol, self.cfg.trainer.compile_atol)

    def _validation_due(self, epoch_end: bool) -> bool:
        if self.val_loader is None:
            return False
        every = self.cfg.trainer.val_every_n_steps
        return epoch_end if every is None else self.state.step % every == 0

    def _validate_and_report(self) -> Optional[Control]:
        metrics = self.validate()
        if not metrics:
            return None
        return self._callbacks.on_validation_end(self.view, metrics)

    def _log(self, running: RunningTrainMetrics) -> Optional[Control]:
        metrics = running.read()
        metrics["train/lr"] = float(self.optimizer.param_groups[0]["lr"])
        self.state.metrics.update(metrics)
        return self._callbacks.on_log(self.view, metrics)

    def _configured_callbacks(self) -> list[Callback]:
        """The `callbacks` nodes, then the `logger` nodes, then the console output."""
        callbacks: list[Callback] = []
        for key in ("callbacks", "logger"):
            for name, node in (getattr(self.cfg, key) or {}).items():
                if node is not None:
                    callbacks.append(self._instantiate(f"{key}.{name}", node))
        callbacks.append(ProgressBar() if want_progress_bar(self.cfg.trainer.progress_bar)
                         else LogLines())
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


def _raise_explained(exc: BaseException, step: int) -> None:
    """Re-raise a bare torch error that saferun can explain, with the fix."""
    if isinstance(exc, RuntimeError) and "Inference tensors cannot be saved" in str(exc):
        raise SaferunError(
            f"step {step}: a tensor created during evaluation, which runs under "
            f"torch.inference_mode(), was used in training (typically a cache or attribute set in "
            f"forward or validation_step). Store a .clone() made outside inference mode, or set "
            f"trainer.eval_grad_mode=no_grad."
        ) from exc


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


def _take(iterator: Iterator[Any], n: int) -> list[Any]:
    group = []
    for batch in iterator:
        group.append(batch)
        if len(group) == n:
            break
    return group


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"trainer.device: {e}. Use auto, cpu, cuda or cuda:N.") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device is cuda but no CUDA device is available; "
                          "use trainer.device=cpu or auto.")
    return device


def _root_cause(e: BaseException) -> str:
    while e.__cause__ is not None:
        e = e.__cause__
    return f"{type(e).__name__}: {e}"
