"""`saferun check`: a short diagnostic session of a Trainer with every guard on.

Each check builds fresh Trainers from the same config (a few steps, outputs in a
temporary directory), so nothing here changes the user's runs. One line per
check: pass, warn or fail, with what was found.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch.utils.data import DataLoader, Subset

from .config import Config
from .data import split_datasets
from .errors import SaferunError
from . import modes
from .loop.batches import BatchStream, first_batch
from .data.seeding import preserved_rng
from .loop.steps import loss_and_logs
from .guards import datachecks
from .loop.optimizers import NO_SINGLE_LOSS, NamedOptimizers, each_optimizer_moves
from .guards.preflight import check_loader, find_rng_objects, find_unpicklable
from .guards.syncs import HostSyncCounter
from .trainer import Trainer

STEPS = 8
DRAWS = 8  # worker seeding: draws of sample 0 per worker


@dataclass
class CheckResult:
    name: str
    status: str  # "pass", "warn", "fail" or "skip" (the check ran but cannot conclude)
    finding: str

    def __str__(self) -> str:
        return f"{self.status.upper():<5} {self.name:<18} {self.finding}"


Factory = Callable[[Config], Trainer]


def run_checks(make: Factory, cfg: Config, only: Optional[Sequence[str]] = None
               ) -> list[CheckResult]:
    """Run every check (or the checks named in `only`, e.g. "determinism") on Trainers built
    by `make` from variants of `cfg`."""
    with tempfile.TemporaryDirectory(prefix="saferun-check-") as tmp:
        base = _short_session(cfg, tmp)
        checks = [_pickling, _worker_seeding, _eval_purity, _declared_modes, _unused_parameters,
                  _host_syncs, _overfit_one_batch, _determinism, _data_overlap, _initial_loss,
                  _batch_independence, _input_baseline, _eval_determinism, _batch_order]
        if cfg.trainer.compile:
            checks.append(_compile_parity)
        if only is not None:
            unknown = set(only) - {_name(c) for c in checks}
            if unknown:
                raise ValueError(f"no check named {', '.join(sorted(unknown))}; checks: "
                                 f"{', '.join(_name(c) for c in checks)}")
            checks = [c for c in checks if _name(c) in only]
        return [_run(check, _in_own_dir(make, tmp), base) for check in checks]


def _name(check: Callable[..., CheckResult]) -> str:
    return check.__name__.lstrip("_").replace("_", " ")


def _run(check: Callable[[Factory, Config], CheckResult], make: Factory, cfg: Config) -> CheckResult:
    name = _name(check)
    if cfg.trainer.compile:
        # Each check builds new models: past torch.compile's recompile limit (8 per function),
        # later checks would run eagerly unsaid, and compile parity would compare eager with eager.
        torch.compiler.reset()
    try:
        return check(make, copy.deepcopy(cfg))
    except SaferunError as e:
        return CheckResult(name, "fail", _one_line(str(e)))
    except Exception as e:  # a check must report, not crash the report
        return CheckResult(name, "fail", f"{type(e).__name__}: {e}")


def _short_session(cfg: Config, tmp: str) -> Config:
    t = dataclasses.replace(cfg.trainer, max_steps=STEPS, log_every_n_steps=STEPS,
                            val_every_n_steps=None, limit_val_batches=2, save_every_n_steps=None,
                            progress_bar=False, run_dir=tmp)
    return dataclasses.replace(cfg, trainer=t, logger={}, resume=None)


def _in_own_dir(make: Factory, tmp: str) -> Factory:
    """`make`, each Trainer training afresh in a new directory under `tmp` (not over the
    previous one's files, which would be moved aside, saying so)."""
    def build(cfg: Config) -> Trainer:
        own = tempfile.mkdtemp(dir=tmp, prefix="trainer-")
        return make(dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, run_dir=own)))
    return build


def _pickling(make: Factory, cfg: Config) -> CheckResult:
    trainer = make(cfg)
    trainer.setup()
    loader = trainer.train_loader
    assert loader is not None
    report = check_loader(loader)
    if report.errors:
        return CheckResult("pickling", "fail", report.errors[0])
    if report.warnings:
        return CheckResult("pickling", "warn", report.warnings[0])
    if loader.num_workers == 0:
        # No workers now, but say whether spawn workers (macOS, Python 3.14's forkserver) would start.
        found = find_unpicklable(loader.dataset, "dataset")
        if found:
            return CheckResult("pickling", "warn", f"{found[0]} (fails once num_workers > 0 under "
                                                   f"spawn or forkserver)")
        rngs = find_rng_objects(loader.dataset, "dataset")
        if rngs:
            return CheckResult("pickling", "warn", f"{rngs[0]} (once num_workers > 0, every "
                                                   f"worker would repeat the same draws)")
    return CheckResult("pickling", "pass", "the dataset and loader functions pickle under spawn")


def _worker_seeding(make: Factory, cfg: Config) -> CheckResult:
    trainer = make(cfg)
    trainer.setup()
    dataset = trainer.train_loader.dataset  # type: ignore[union-attr]
    if not hasattr(dataset, "__len__") or len(dataset) == 0:
        return CheckResult("worker seeding", "pass", "not a map-style dataset: not checked")
    # Several draws each: one draw of a small augmentation (a shift of -1, 0 or 1) would
    # often match by chance.
    repeated = [dataset[0] for _ in range(DRAWS)]
    if all(_same(repeated[0], r) for r in repeated[1:]):
        return CheckResult("worker seeding", "pass", "sample 0 is deterministic (no random augmentation)")
    # Sample 0 fetched DRAWS times by each of two workers (batch i comes from worker i % 2):
    # random augmentation must differ.
    loader = DataLoader(Subset(dataset, [0] * (2 * DRAWS)), batch_size=1, num_workers=2,
                        worker_init_fn=trainer.train_loader.worker_init_fn,  # type: ignore[union-attr]
                        multiprocessing_context=cfg.trainer.multiprocessing_context)
    draws = list(loader)
    if _same(draws[0::2], draws[1::2]):
        return CheckResult("worker seeding", "fail",
                           f"two DataLoader workers produced the same random augmentations of "
                           f"sample 0 ({DRAWS} draws each): the dataset draws from a generator "
                           f"object that every worker copies (see the pickling/preflight warnings)")
    return CheckResult("worker seeding", "pass", "workers draw different augmentations")


def _eval_purity(make: Factory, cfg: Config) -> CheckResult:
    cfg.guards.eval_purity = True
    trainer = make(cfg)
    trainer.setup()
    if trainer.val_loader is None:
        return CheckResult("eval purity", "pass", "no validation set: not checked")
    _first_forward(trainer, cfg.seed)
    trainer.validate()  # raises, naming the tensor, if evaluation changes the model
    return CheckResult("eval purity", "pass",
                       "validation leaves every parameter and buffer unchanged, no inference tensors")


def _first_forward(trainer: Trainer, seed: int) -> None:
    """One training forward (no gradient, training's modes), as training makes before any
    validation: torch's lazy modules (nn.LazyLinear) take their shapes there, and a module
    that keeps a copy of its output (`self.last = y.detach()`) writes it there; otherwise
    their new parameters would read as an evaluation that changed the model (and as inference
    tensors, made in inference mode)."""
    assert trainer.train_loader is not None
    batch = first_batch(trainer.train_loader, seed, 0, trainer.device, False)
    with modes.training(trainer.model, _frozen(trainer)), torch.no_grad(), preserved_rng():
        trainer.forward_only(batch)  # several optimizers: its optimize() calls update nothing


def _declared_modes(make: Factory, cfg: Config) -> CheckResult:
    cfg.guards.declared_modes = True
    make(cfg).fit()
    frozen = ", ".join(cfg.trainer.frozen_modules) or "none"
    return CheckResult("declared modes", "pass", f"every step in train mode except frozen modules ({frozen})")


def _unused_parameters(make: Factory, cfg: Config) -> CheckResult:
    cfg.guards.unused_params = True
    records: list[logging.LogRecord] = []
    handler = _Collect(records)
    logger = logging.getLogger("saferun")
    logger.addHandler(handler)
    try:
        make(cfg).fit()
    finally:
        logger.removeHandler(handler)
    unused = [r.getMessage() for r in records if "received no gradient" in r.getMessage()]
    if unused:
        return CheckResult("unused parameters", "warn", unused[0].split(":")[0] + ": " +
                           unused[0].split(": ", 1)[1].split(". ")[0])
    return CheckResult("unused parameters", "pass", "every trainable parameter gets a gradient")


def step_syncs(trainer: Trainer) -> list[dict[str, int]]:
    """The host syncs of each training step of `trainer` (set up, `max_steps` steps), as
    `HostSyncCounter.sites`: the steps alone, as between log points. The steps' batches come
    from a stream of the loop's own kind over the Trainer's loader (grouped for accumulation,
    each epoch's shuffle seeded as in fit)."""
    steps = []
    cfg = trainer.cfg
    stream = BatchStream(trainer.train_loader, cfg.trainer, cfg.seed, trainer.state, False)  # type: ignore[arg-type]  # set up: a loader
    with HostSyncCounter() as counter:
        for micro_batches, _, _ in stream.groups():
            counter.reset()
            trainer.train_step(micro_batches)
            steps.append(dict(counter.sites))
    return steps


def _host_syncs(make: Factory, cfg: Config) -> CheckResult:
    trainer = make(cfg)
    trainer.setup()
    steps = step_syncs(trainer)
    per_step = sum(sum(s.values()) for s in steps) / max(len(steps), 1)
    if per_step:
        from .guards.sync_audit import audit

        top = audit(steps)[0]
        if top.caller:
            return CheckResult("host syncs", "warn", (
                f"{per_step:.2f} per step; most in library code at {top.site} ({top.code}), "
                f"called from your line {top.caller} ({top.caller_code}): the library reads a "
                f"value of what that call passes; change the call (an argument it inspects, "
                f"such as an all-ones mask, can often be left out) or make it at log points only"))
        return CheckResult("host syncs", "warn", f"{per_step:.2f} per step; most at {top.site} "
                                                 f"({top.code}). Keep values on the device.")
    return CheckResult("host syncs", "pass", "0 per training step between log points")


def _overfit_one_batch(make: Factory, cfg: Config) -> CheckResult:
    trainer = make(cfg)
    trainer.setup()
    batch = next(iter(trainer.train_loader))  # type: ignore[arg-type]
    trainer.model.train()
    if isinstance(trainer.optimizer, NamedOptimizers):  # several optimizers: losses may be adversarial
        return CheckResult("one-batch overfit", *each_optimizer_moves(trainer, batch, 4 * STEPS))
    losses = [float(trainer.train_step([batch]).loss) for _ in range(4 * STEPS)]
    if losses[-1] < losses[0] and not losses[-1] < 0.9 * losses[0]:  # falling, slowly
        return CheckResult("one-batch overfit", "skip",
                           f"inconclusive: the loss on one repeated batch fell, but only "
                           f"{losses[0]:.4g} -> {losses[-1]:.4g} in {len(losses)} steps: a "
                           f"learning rate still warming up or small, or a loss with small "
                           f"gradients (Huber)")
    if not losses[-1] < 0.9 * losses[0]:
        return CheckResult("one-batch overfit", "warn",
                           f"the loss on one repeated batch went {losses[0]:.4g} -> {losses[-1]:.4g} "
                           f"in {len(losses)} steps; expected it to fall. Check the learning rate, "
                           f"the loss and that the model's output depends on the input.")
    return CheckResult("one-batch overfit", "pass",
                       f"loss on one repeated batch {losses[0]:.4g} -> {losses[-1]:.4g}")


def _determinism(make: Factory, cfg: Config) -> CheckResult:
    runs = []
    for _ in range(2):
        trainer = make(copy.deepcopy(cfg))
        trainer.fit()
        runs.append({k: v.detach().clone() for k, v in trainer.model.state_dict().items()})
    differ = [k for k in runs[0] if not torch.equal(runs[0][k], runs[1][k])]
    if differ:
        return CheckResult("determinism", "fail",
                           f"two runs with seed {cfg.seed} gave different weights ({differ[0]}, "
                           f"...): something draws randomness saferun does not seed, or uses "
                           f"non-deterministic kernels")
    return CheckResult("determinism", "pass", f"two {STEPS}-step runs with one seed: identical weights")


def _data_overlap(make: Factory, cfg: Config) -> CheckResult:
    trainer = make(cfg)
    train, val, _ = split_datasets(trainer.build_datasets(), type(trainer).__name__)  # (test set: not checked)
    if val is None or not all(hasattr(d, "__len__") for d in (train, val)):
        return CheckResult("data overlap", "pass", "no map-style validation set: not checked")
    with preserved_rng():
        return CheckResult("data overlap", *datachecks.overlap(train, val))


def _first_batch(make: Factory, cfg: Config) -> tuple[Trainer, Any]:
    trainer = make(cfg)
    trainer.setup()
    assert trainer.train_loader is not None
    return trainer, first_batch(trainer.train_loader, cfg.seed, 0, trainer.device, False)


def _initial_loss(make: Factory, cfg: Config) -> CheckResult:
    trainer, batch = _first_batch(make, cfg)
    if isinstance(trainer.optimizer, NamedOptimizers):
        return CheckResult("initial loss", "pass", NO_SINGLE_LOSS)
    outputs: list[Any] = []
    handle = trainer.model.register_forward_hook(lambda m, a, out: outputs.append(out))
    try:
        with modes.training(trainer.model, _frozen(trainer)), torch.no_grad(), \
                datachecks.first_layer_input(trainer.model, trainer.batch_size(batch)) as seen:
            loss, _ = loss_and_logs(trainer.training_step(batch), 0, need_grad=False)
    finally:
        handle.remove()
    out = datachecks.scores(outputs[0]) if outputs else None
    expected = datachecks.expected_initial_loss(batch, out) if out is not None else None
    return CheckResult("initial loss", *datachecks.initial_loss_finding(
        float(loss), expected, datachecks.unnormalised(seen)))


def _batch_independence(make: Factory, cfg: Config) -> CheckResult:
    trainer, batch = _first_batch(make, cfg)
    rows = trainer.batch_size(batch)
    with modes.evaluating(trainer.model, "no_grad"), torch.enable_grad():
        try:
            return CheckResult("batch independence", *datachecks.batch_dependence(
                trainer.model, _model_call(trainer, batch), rows))
        except _NotChecked as e:
            return CheckResult("batch independence", "skip", str(e))


class _NotChecked(Exception):
    """A check cannot run on this Trainer (what it needs from the user's code failed)."""


def _model_call(trainer: Trainer, batch: Any) -> Callable[[bool], Any]:
    """call(roll): the model's output on `batch` (its samples rolled by one row if `roll`):
    the model called as training_step calls it (positional or keyword arguments), or
    predict_step if training_step calls only submodules."""
    model = trainer.model
    with torch.no_grad(), preserved_rng():
        called = datachecks.model_call(model, lambda: trainer.forward_only(batch))
    rows = trainer.batch_size(batch)
    if called is not None:
        args, kwargs = called
        return lambda roll: model(*datachecks.rolled(args, rows), **datachecks.rolled(kwargs, rows)) \
            if roll else model(*args, **kwargs)

    def predict(roll: bool) -> Any:
        try:
            return trainer.predict_step(datachecks.rolled(batch, rows) if roll else batch)
        except Exception as e:
            raise _NotChecked(
                f"not checked, because training_step does not call the model itself and "
                f"predict_step(batch) raised {type(e).__name__}: {e}. Override "
                f"predict_step(batch) to return the model's output for a batch.") from e
    return predict


def _input_baseline(make: Factory, cfg: Config) -> CheckResult:
    """Fit one repeated batch twice, with zeroed and with real inputs, then compare the loss
    on it in eval mode (no dropout noise): only a model that uses its inputs gets lower."""
    steps, starts, losses, zeroed_calls = 2 * STEPS, [], [], [0]
    for zeroed in (True, False):
        trainer, batch = _first_batch(make, copy.deepcopy(cfg))
        if isinstance(trainer.optimizer, NamedOptimizers):
            return CheckResult("input baseline", "pass", NO_SINGLE_LOSS)
        handle = datachecks.zeroing_inputs(trainer.model, zeroed_calls) if zeroed else None
        try:
            with preserved_rng():  # the loss before fitting: the same draws follow either way
                starts.append(_eval_loss(trainer, batch))
            if zeroed and not zeroed_calls[0]:
                return CheckResult("input baseline", "pass", "not checked, because "
                                   "training_step does not call the model itself (only its "
                                   "submodules) with a tensor input")
            with modes.training(trainer.model, _frozen(trainer)):
                for _ in range(steps):
                    trainer.train_step([batch])
            losses.append(_eval_loss(trainer, batch))
        finally:
            if handle is not None:
                handle.remove()
    return CheckResult("input baseline", *datachecks.baseline_finding(
        losses[1], losses[0], (starts[1], starts[0]), steps))


def _eval_loss(trainer: Trainer, batch: Any) -> float:
    with modes.evaluating(trainer.model, "no_grad"):
        return float(loss_and_logs(trainer.training_step(batch), 0, False)[0])


def _eval_determinism(make: Factory, cfg: Config) -> CheckResult:
    """The same validation batch evaluated twice in eval mode must give the same outputs: the
    sample read twice from the dataset (a random transform on the validation data), then the
    model's modules (a random op that eval mode does not turn off)."""
    trainer = make(cfg)
    trainer.setup()
    loader = trainer.val_loader or trainer.train_loader
    assert loader is not None
    which = "validation" if trainer.val_loader is not None else "training"
    data = loader.dataset
    with preserved_rng():
        if hasattr(data, "__len__") and hasattr(data, "__getitem__") and len(data) > 0:
            if not all(_same(data[0], data[0]) for _ in range(3)):
                return CheckResult("eval determinism", "fail",
                                   f"{which} sample 0 differs when read twice from "
                                   f"{type(data).__name__}: its transform is random, so "
                                   f"validation scores change from one evaluation to the next. "
                                   f"Give the {which} data deterministic transforms (random "
                                   f"augmentation belongs to the training data only).")
        batch = first_batch(loader, cfg.seed, 0, trainer.device, False)
        step = trainer.validation_step if trainer.val_loader is not None else trainer.predict_step
        with modes.evaluating(trainer.model, "inference_mode"):
            found = datachecks.nondeterministic_module(trainer.model, lambda: step(batch))
    if found:
        return CheckResult("eval determinism", "fail", found)
    return CheckResult("eval determinism", "pass",
                       f"one {which} batch evaluated twice in eval mode: identical outputs")


def _batch_order(make: Factory, cfg: Config) -> CheckResult:
    trainer = make(cfg)
    trainer.setup()
    assert trainer.train_loader is not None
    if not cfg.trainer.shuffle:
        return CheckResult("batch order", "pass", "trainer.shuffle=false: the order is intended")
    with preserved_rng():
        batches = []
        for batch in trainer.train_loader:
            batches.append(batch)
            if len(batches) == STEPS:
                break
    return CheckResult("batch order", *datachecks.single_class_batches(batches))


def _compile_parity(make: Factory, cfg: Config) -> CheckResult:
    # the check fit() runs before its first step (the compiled model against eager), then
    # one compiled step
    make(dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, max_steps=1))).fit()
    return CheckResult("compile parity", "pass", "compiled and eager agree on the first batch: "
                       "the eval-mode loss; the training-mode loss, gradients and buffers")


def _frozen(trainer: Trainer) -> list[torch.nn.Module]:
    """The modules trainer.frozen_modules names, which stay in eval mode in training."""
    return modes.resolve_modules(trainer.model, trainer.cfg.trainer.frozen_modules)


def _one_line(message: str, limit: int = 400) -> str:
    text = " ".join(line.strip() for line in message.splitlines())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


class _Collect(logging.Handler):
    def __init__(self, records: list[logging.LogRecord]) -> None:
        super().__init__(logging.WARNING)
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def format_report(results: list[CheckResult]) -> str:
    lines = [str(r) for r in results]
    failed = sum(r.status == "fail" for r in results)
    warned = sum(r.status == "warn" for r in results)
    skipped = sum(r.status == "skip" for r in results)
    lines.append(f"{len(results)} checks: {len(results) - failed - warned - skipped} passed, "
                 + (f"{skipped} inconclusive, " if skipped else "")
                 + f"{warned} warned, {failed} failed.")
    return "\n".join(lines)


def exit_status(results: list[CheckResult]) -> int:
    return 1 if any(r.status == "fail" for r in results) else 0


def make_factory(task: Optional[dict[str, Any]]) -> Factory:
    """A Trainer factory for a config's `task` node (or plain `Trainer`)."""
    from hydra.utils import get_class

    kwargs = dict(task or {"_target_": "saferun.Trainer"})
    cls = get_class(kwargs.pop("_target_"))
    return lambda cfg: cls(cfg, **kwargs)
