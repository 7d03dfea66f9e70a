"""Typed configuration: dataclasses that double as Hydra structured configs.

`Config` is the whole run; each component reads only its own node (`trainer`,
`optim`, `sched`, `model`, `data`). `load_config` turns a dataclass, a dict or
an OmegaConf node into a validated `Config` of plain Python objects, so the
training loop never touches OmegaConf (an OmegaConf attribute read costs
about 10 us; a dataclass attribute about 0.03 us).
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from .errors import ConfigError
from .direction import metric_mode
from .guards.policies import POLICIES

PRECISIONS = ("fp32", "bf16", "fp16")
STRATEGIES = ("auto", "ddp", "fsdp", "mesh")
EVAL_GRAD_MODES = ("inference_mode", "no_grad")
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP")
DEFAULT_MAX_STEPS = 1000  # trainer.max_steps when neither it nor trainer.max_epochs is set
# saferun modules a config's _target_ may name from before they moved: old prefix -> new
MOVED = {"saferun.trackers.": "saferun.loggers.trackers."}


@dataclass
class EmaConfig:
    """trainer.ema: an exponential moving average of the weights (off by default), validated beside
    the raw weights (val_ema/...), checkpointed, and exported as <run_dir>/model_ema.pt."""

    decay: Optional[float] = None
    """ema = decay * ema + (1 - decay) * weights after each optimizer step (e.g. 0.999; null: off)."""
    use_buffers: bool = True
    """Average floating buffers (BatchNorm statistics) too; false: copy them. Integers are copied."""

    def __post_init__(self) -> None:
        if isinstance(self.decay, (int, float)) and not 0.0 < self.decay < 1.0:
            raise ConfigError(f"trainer.ema.decay must be in (0, 1), e.g. 0.999, or null; got {self.decay}.")


@dataclass
class FSDPConfig:
    """trainer.strategy=fsdp: how FSDP2 (`fully_shard`) shards the model (docs/distributed.md)."""

    shard: list[str] = field(default_factory=list)
    """Submodules sharded as units of their own, by class name (Block) or path (blocks.0);
    the root is always one. Empty: each child of a ModuleList/Sequential whose children are
    all of one class (the blocks of a Transformer)."""
    reshard_after_forward: bool = True
    """Free each unit's gathered parameters after its forward (gathered again for backward):
    less memory, one more all-gather per unit per micro-batch."""
    param_dtype: Optional[str] = None
    """bf16: parameters gathered and computed in bf16, gradients reduced in fp32
    (MixedPrecisionPolicy); the sharded parameters and optimizer state stay fp32. null: fp32."""
    cpu_offload: bool = False
    """Keep the sharded parameters, gradients and optimizer state in host memory (CUDA only:
    the optimizer steps on the CPU)."""
    async_save: bool = False
    """Write checkpoints in a background thread (torch.distributed.checkpoint.async_save):
    training goes on after a copy of the state; the checkpoint is completed (manifest,
    rename) at the next log point after every rank's write finished, or the next save."""

    def __post_init__(self) -> None:
        if self.param_dtype not in (None, "bf16", "fp32"):
            raise ConfigError(f"trainer.fsdp.param_dtype must be bf16, fp32 or null; got "
                              f"{self.param_dtype!r}.")


@dataclass
class ParallelConfig:
    """trainer.strategy=mesh: the device mesh's shape, data dimension first (docs/distributed.md)."""

    dp_shard: Optional[int] = None
    """Ranks the data is split over, the model sharded over with FSDP2 (1: not sharded). null:
    the processes left over by tp (world size / tp)."""
    tp: int = 1
    """Ranks of one tensor-parallel group: the task's parallelize(model, mesh) splits each
    layer over mesh["tp"]; they see the same batches."""

    def __post_init__(self) -> None:
        for key in ("dp_shard", "tp"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ConfigError(f"trainer.parallel.{key} must be a positive integer"
                                  f"{' or null' if key == 'dp_shard' else ''}; got {value!r}.")


@dataclass
class SweepConfig:
    """The objective of a sweep: the summary ranks the jobs by it, an Optuna sweep optimizes it."""

    metric: Optional[str] = None
    """A validation metric (e.g. val/acc); None: trainer.save_best's metric, else val/loss."""
    mode: Optional[str] = None
    """min or max. None: trainer.save_best_mode for save_best's metric, else the direction the
    metric's name says (as trainer.save_best_mode); a name that says none is refused."""

    def __post_init__(self) -> None:
        if self.mode not in (None, "min", "max"):
            raise ConfigError(f"sweep.mode must be min or max, got {self.mode!r}.")


@dataclass
class TrainerConfig:
    """Knobs of the training loop. Every field is checked in `__post_init__`."""

    max_steps: Optional[int] = None
    """Optimizer steps to train for. None: 1000 when max_epochs is not set either; with
    max_epochs alone, no step limit (the epochs end the run). Both set: whichever comes first."""
    max_epochs: Optional[int] = None
    """Stop after this many passes over the training data (None: only max_steps)."""
    batch_size: int = 32
    """Samples per micro-batch."""
    val_batch_size: Optional[int] = None
    """Samples per validation batch (None: batch_size)."""
    accumulate: int = 1
    """Micro-batches per optimizer step (gradient accumulation)."""
    max_grad_norm: Optional[float] = 1.0
    """Clip the total gradient norm to this value (None: measure only, never clip)."""
    log_every_n_steps: int = 50
    """Read the on-device metric sums to the host every this many steps."""
    val_every_n_steps: Optional[int] = None
    """Validate every this many steps (None: at the end of each epoch)."""
    limit_val_batches: Optional[int] = None
    """Use at most this many validation batches (None: all)."""
    eval_grad_mode: str = "inference_mode"
    """How evaluation disables autograd: inference_mode or no_grad."""
    precision: str = "fp32"
    """fp32, bf16 (autocast, CPU or CUDA) or fp16 (autocast + GradScaler, CUDA only)."""
    device: str = "auto"
    """auto (cuda if available, else cpu), cpu, cuda, cuda:N."""
    compile: bool = False
    """Compile the model with torch.compile and check it against eager on the first batch."""
    compile_backend: str = "inductor"
    """torch.compile backend."""
    compile_rtol: float = 1e-4
    compile_atol: float = 1e-5
    """Tolerances of the compiled-vs-eager check."""
    frozen_modules: list[str] = field(default_factory=list)
    """Submodule paths (as in named_modules) kept in eval mode with requires_grad=False."""
    activation_checkpointing: list[str] = field(default_factory=list)
    """Module class names (e.g. [Block]) whose forward is recomputed in the backward instead of
    keeping its activations: less memory for more compute. Buffers are updated once per step."""
    num_workers: int = 0
    """DataLoader worker processes."""
    num_threads: Any = "auto"
    """Threads torch computes with (intra- and inter-op): auto (this process's share of the
    cores it may use, os.sched_getaffinity, among the processes of the job on the node, less
    the loader workers; at least 1, never more than torch has) or a number. The environment's
    OMP_NUM_THREADS wins over auto. The plan is logged once at start-up (docs/speed.md)."""
    multiprocessing_context: Optional[str] = None
    """Worker start method: fork, spawn, forkserver (None: Python's default)."""
    pin_memory: Optional[bool] = None
    """Pin host memory for batches (None: on when training on CUDA)."""
    find_unused_parameters: bool = False
    """Under torchrun: let DistributedDataParallel handle parameters without gradients."""
    collective_timeout: float = 600.0
    """Under torchrun: seconds a rank waits in a collective for the others before the job
    fails (instead of hanging). Raise it if saving a checkpoint or one rank's work between
    two collectives can take longer."""
    shuffle: bool = True
    """Shuffle the training data each epoch."""
    drop_last: bool = False
    """Drop the last incomplete training batch of each epoch."""
    save_every_n_steps: Optional[int] = 1000
    """Checkpoint every this many steps (None: only at the end and on preemption)."""
    keep_last: int = 3
    """Checkpoints to keep (the newest); older ones are deleted once a new one is complete."""
    save_best: Optional[str] = None
    """Also keep the checkpoint with the best value of this validation metric (e.g. val/acc)."""
    save_best_mode: Optional[str] = None
    """min or max: which direction of save_best is better. None: the one its name says (loss,
    error, mse, mae, mape, perplexity: min; acc, f1, auc, r2, precision, recall, bleu, map: max,
    said in the log); a name that says none is refused."""
    sched_metric: Optional[str] = None
    """The validation metric (e.g. val/loss) a scheduler stepped with a metric, such as
    ReduceLROnPlateau, watches: it is stepped after each validation. Required by such a
    scheduler, refused with any other."""
    stop_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGINT"])
    """Signals that stop training at the next step boundary, after saving a checkpoint (exit
    status 128 + the signal's number). Add SIGUSR1 or SIGUSR2 where a scheduler sends one
    before the time limit (a job of Hydra's submitit launcher adds its preemption signal)."""
    progress_bar: Optional[bool] = None
    """Show a tqdm bar (None: only when stderr is a terminal)."""
    run_dir: Optional[str] = None
    """Directory for this run's outputs (None: a new runs/<timestamp>-<4 hex>/ for each Trainer)."""
    ema: EmaConfig = field(default_factory=EmaConfig)  # weight averaging, see EmaConfig
    strategy: str = "auto"
    """Under torchrun: ddp (every rank holds the whole model), fsdp (parameters, gradients and
    optimizer state sharded over the ranks, FSDP2), mesh (a device mesh of trainer.parallel's
    shape: the task's parallelize() plan, e.g. tensor parallel, and FSDP2 over the data
    dimension) or auto (ddp under torchrun, else one process)."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """trainer.strategy=fsdp's settings (and mesh's, for its data dimension)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """trainer.strategy=mesh: the device mesh's shape (dp_shard x tp)."""

    def best_mode(self) -> str:
        """save_best's direction: save_best_mode, else the one the metric's name says."""
        return metric_mode(self.save_best or "", self.save_best_mode, "trainer.save_best",
                           "trainer.save_best_mode={mode}")

    def __post_init__(self) -> None:
        if self.max_steps is None and self.max_epochs is None:
            self.max_steps = DEFAULT_MAX_STEPS  # the only limit: a default, not a silent cap
        _positive(self, "batch_size", "accumulate", "log_every_n_steps", "keep_last",
                  "collective_timeout")
        _positive_or_none(self, "max_steps", "max_epochs", "val_batch_size", "val_every_n_steps",
                          "limit_val_batches", "max_grad_norm", "save_every_n_steps")
        if self.save_best_mode is not None or self.save_best is not None:
            self.best_mode()  # now: a direction the name does not say is refused before training
        _one_of(self, "precision", PRECISIONS)
        _one_of(self, "eval_grad_mode", EVAL_GRAD_MODES)
        _one_of(self, "strategy", STRATEGIES)
        unknown = [s for s in self.stop_signals if s not in STOP_SIGNALS]
        if unknown or not {"SIGTERM", "SIGINT"} <= set(self.stop_signals):
            raise ConfigError(f"trainer.stop_signals must hold SIGTERM and SIGINT, and may add "
                              f"{', '.join(STOP_SIGNALS[2:])}; got {list(self.stop_signals)}.")
        if self.num_threads != "auto" and (type(self.num_threads) is not int or self.num_threads < 1):
            raise ConfigError(f"trainer.num_threads must be auto or a number of threads >= 1, got "
                              f"{self.num_threads!r}.")
        if isinstance(self.num_workers, int) and self.num_workers < 0:
            raise ConfigError(f"trainer.num_workers must be >= 0, got {self.num_workers}.")
        if self.multiprocessing_context not in (None, "fork", "spawn", "forkserver"):
            raise ConfigError(
                "trainer.multiprocessing_context must be fork, spawn, forkserver or null, "
                f"got {self.multiprocessing_context!r}."
            )
        if min(self.compile_rtol, self.compile_atol) < 0:
            raise ConfigError("trainer.compile_rtol and trainer.compile_atol must be >= 0.")
        for key in ("save_best", "sched_metric"):  # now, not after training to a validation
            if str(getattr(self, key)).startswith("val_ema/") and not getattr(self.ema, "decay", 0):
                raise ConfigError(f"trainer.{key}={getattr(self, key)} watches the weight average, "
                                  f"but trainer.ema is off: set trainer.ema.decay (e.g. 0.999).")


NONFINITE_POLICIES = tuple(POLICIES)  # raise, skip, rollback, off: guards/policies.py


@dataclass
class GuardsConfig:
    """Safety checks on the user's code and data. The cheap ones are on by default."""

    nonfinite: str = "raise"
    """NaN/Inf in the loss or gradients: raise (checked at log points, no per-step sync),
    skip (drop that update and restore the buffers its forward changed, e.g. BatchNorm statistics;
    one host sync and one copy of the buffers per step), rollback (restore the last checkpoint and
    go on with the next data), or off."""
    max_consecutive: int = 5
    """skip/rollback: stop after this many non-finite steps (or rollbacks) in a row."""
    check_params: bool = False
    """Also check the parameters, at log points (their total norm is then logged as
    train/param_norm), validations and saves: a checkpoint never holds a non-finite one."""
    anomaly_replay: bool = False
    """On a non-finite step, replay it from the last checkpoint under detect_anomaly and name
    the operation that produced it (keeps a step-0 checkpoint so there is always one)."""
    unused_params: bool = True
    """Name the trainable parameters that received no gradient in any of the first 20 steps
    (a routed expert without one on some steps is not named)."""
    spikes: str = "off"
    """Loss spikes and gradient explosions (each step compared on the device with a limit from
    robust median/MAD statistics of the recent steps, refreshed every log interval and at least
    four times per spike_window): raise or rollback (the steps compared at the log point and
    before a save, all at once: nothing per step), skip (each step before its update: about 5
    small device ops and one host sync per step) or off. guards=strict turns on raise."""
    spike_window: int = 100
    spike_threshold: float = 6.0
    """A spike is above median + threshold * 1.4826 * MAD of the last spike_window steps."""
    spike_warmup: int = 20
    """Steps of history needed before anything is flagged."""
    preflight: bool = True
    """Before the first step: check what DataLoader workers receive (pickling under the start
    method in use, and spawn/forkserver), generator objects on the dataset, CPU-only batches."""
    eval_purity: bool = True
    """Validation and predict must not change any parameter or buffer, nor leave inference
    tensors on the model (fingerprints on the device, one host read per evaluation)."""
    declared_modes: bool = True
    """At every step: frozen modules in eval mode, everything else in train mode."""
    model_audit: bool = True
    """Around the first step, once: the model's state (modules or parameters in plain lists or
    dicts, parameters made in forward, plain tensor attributes that training changes, a graph
    carried into the next step) and torch's loss calls (shapes that broadcast, class indices
    out of range, probabilities where scores are expected). Nothing after the first step."""
    sync_audit: bool = False
    """A diagnostic, not a guard: count the host syncs of sampled steps (the first 20, then one
    in every 1000) and report their source lines; an audited step costs about 3-4x."""

    def __post_init__(self) -> None:
        for key in ("nonfinite", "spikes"):
            if getattr(self, key) not in NONFINITE_POLICIES:
                raise ConfigError(f"guards.{key} must be one of {', '.join(NONFINITE_POLICIES)}; "
                                  f"got {getattr(self, key)!r}.")
        if isinstance(self.spike_window, int) and not 1 <= self.spike_warmup <= self.spike_window:
            raise ConfigError(f"guards.spike_warmup must be between 1 and guards.spike_window="
                              f"{self.spike_window}; got {self.spike_warmup}.")
        if isinstance(self.spike_threshold, (int, float)) and self.spike_threshold <= 0:
            raise ConfigError(f"guards.spike_threshold must be > 0, got {self.spike_threshold}.")
        if isinstance(self.max_consecutive, int) and self.max_consecutive < 1:
            raise ConfigError(f"guards.max_consecutive must be >= 1, got {self.max_consecutive}.")


def _adamw() -> dict[str, Any]:
    return {"_target_": "torch.optim.AdamW", "lr": 1e-3}


def default_loggers() -> dict[str, Any]:
    """The `logger` nodes of a config that names none: TensorBoard and metrics.jsonl."""
    return {"tensorboard": {"_target_": "saferun.loggers.TensorBoardLogger"},
            "jsonl": {"_target_": "saferun.loggers.MetricsJsonl"}}


@dataclass
class Config:
    """A whole run: the loop's knobs plus `_target_` nodes for the components."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    guards: GuardsConfig = field(default_factory=GuardsConfig)
    optim: Any = field(default_factory=_adamw)
    """Optimizer: `_target_` plus keyword arguments; `params` is passed by the Trainer."""
    sched: Any = None
    """LR scheduler: `_target_` plus arguments, or null. Stepped once per optimizer step that ran
    (a ReduceLROnPlateau: after each validation, see trainer.sched_metric)."""
    model: Any = None
    """Model `_target_` node, used by the default `Trainer.build_model`."""
    data: Any = None
    """Data `_target_` node returning (train, val) datasets, used by `build_datasets`."""
    collate_fn: Any = None
    """`_target_` node of the function that turns a list of samples into a batch, for the
    training, validation and predict loaders (null: torch's default_collate). A function
    needs `_partial_: true`; a class is instantiated with the node's arguments. It must be
    importable by module name, so that spawned DataLoader workers can receive it."""
    callbacks: Any = None
    """Named callback `_target_` nodes ({name: node}), called in this order."""
    logger: Any = field(default_factory=default_loggers)
    """Named logger `_target_` nodes (rank 0, after callbacks); default: `default_loggers()`. A mapping
    given is the whole set (`{}`: none) unless a name maps to None: then it edits the defaults."""
    metrics: Any = None
    """{name: torchmetrics.Metric `_target_` node} for the default `Trainer.build_metrics`."""
    task: Any = None
    """The Trainer subclass the command line runs: `_target_` plus its extra arguments."""
    name: str = "run"
    """Name of the run; the command line puts runs under runs/<name>/."""
    resume: Optional[str] = None
    """auto (the newest good checkpoint in trainer.run_dir, else a fresh start), fresh (start over
    there: an earlier run's checkpoints and logs are moved aside), or a checkpoint's or run's path."""
    force_resume: bool = False
    """Resume even if the config differs from the checkpoint's in keys that change results."""
    seed: int = 0
    """Seeds Python, NumPy and torch, the shuffling order and every DataLoader worker."""
    sweep: SweepConfig = field(default_factory=SweepConfig)
    """What a sweep (`saferun run -m`) ranks its jobs by; see SweepConfig."""

    def __post_init__(self) -> None:
        lr = self.optim.get("lr") if isinstance(self.optim, Mapping) else None
        if isinstance(lr, (int, float)) and lr < 0:
            raise ConfigError(f"optim.lr must be >= 0, got {lr}.")
        for key in ("optim", "sched", "model", "data", "collate_fn"):
            _check_target_node(key, getattr(self, key), required=(key == "optim"))
        _check_partial_function("collate_fn", self.collate_fn)
        for key in ("callbacks", "logger", "metrics"):
            nodes = getattr(self, key) or {}
            if not isinstance(nodes, Mapping):
                raise ConfigError(f"{key} must map names to _target_ nodes, got {nodes!r}.")
            for name, node in nodes.items():
                if node is not None:  # `callbacks.name=null` removes one
                    _check_target_node(f"{key}.{name}", node, required=True)
        if self.task is not None:
            _check_target_node("task", self.task, required=True)


def load_config(cfg: Config | Mapping[str, Any] | Any | None) -> Config:
    """Validate `cfg` against the `Config` schema and return plain dataclasses.

    Accepts a `Config`, a nested dict, an OmegaConf node or None (all defaults).
    Unknown keys, wrong types and out-of-range values raise `ConfigError` naming
    the key.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    schema = OmegaConf.structured(Config)
    cfg = dataclasses.asdict(cfg) if isinstance(cfg, Config) else cfg
    if isinstance(cfg, Mapping):
        _check_named_nodes(cfg)
    if isinstance(cfg, Mapping) and isinstance(cfg.get("logger"), Mapping):  # {"mlflow": {...}}
        cfg = {**cfg, "logger": with_targets(cfg["logger"])}
    try:
        merged = schema if cfg is None else OmegaConf.merge(schema, cfg)
        result = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(_describe_omegaconf_error(e)) from None
    assert isinstance(result, Config)
    if isinstance(cfg, Mapping) and isinstance(cfg.get("logger"), Mapping):  # merged into the defaults
        result.logger = chosen_loggers(cfg["logger"], result.logger, default_loggers())
    return result


def resolved_with_limits(given: Any, trainer: Mapping[str, Any]) -> dict[str, Any]:
    """The config `given` (as a Trainer was given it: a mapping or an OmegaConf node) resolved
    by `load_config` with `trainer`'s max_steps and max_epochs, as plain data: what its
    interpolations of the run's limits (`${trainer.max_steps}`) become with those."""
    from omegaconf import OmegaConf

    limits = {k: trainer[k] for k in ("max_steps", "max_epochs")}
    return dataclasses.asdict(load_config(OmegaConf.merge(OmegaConf.create(given), {"trainer": limits})))


def _check_named_nodes(cfg: Mapping[str, Any]) -> None:
    """logger, callbacks and metrics map names to nodes: a list (Lightning's habit) is refused
    with the form they take, before OmegaConf's 'Cannot merge DictConfig with ListConfig'."""
    from omegaconf import ListConfig

    examples = {"logger": "{'tensorboard': {'_target_': 'saferun.loggers.TensorBoardLogger'}} "
                          "(default_loggers() for the defaults, {} for none); on the command "
                          "line logger=tensorboard",
                "callbacks": "{name: {'_target_': ...}}; callback objects go to "
                             "Trainer(cfg, callbacks=[...])",
                "metrics": "{name: {'_target_': ...}} (torchmetrics classes)"}
    for key, example in examples.items():
        if isinstance(cfg.get(key), (list, tuple, ListConfig)):
            raise ConfigError(f"{key} is a list ({list(cfg[key])!r}); it maps names to "
                              f"`_target_` nodes: {example}.")


def _describe_omegaconf_error(e: Exception) -> str:
    key = getattr(e, "full_key", None) or "?"
    first_line = str(e).splitlines()[0]
    if type(e).__name__ == "ConfigKeyError":
        from .suggest import did_you_mean

        return (f"unknown config key '{key}': {first_line}.{did_you_mean(key, Config)} Check the spelling "
                f"against saferun.config.")
    return f"config key '{key}': {first_line}."


def _check_target_node(key: str, node: Any, required: bool) -> None:
    if node is None:
        if required:
            raise ConfigError(f"{key} must be a node with a _target_, got null.")
        return
    if not isinstance(node, Mapping) or "_target_" not in node:
        raise ConfigError(f"{key} must be a mapping with a '_target_' key, got {node!r}.")
    check_target_signature(key, node)


def _check_partial_function(key: str, node: Any) -> None:
    """A function given as a `_target_` is called by instantiate unless `_partial_` is set."""
    from hydra.utils import get_object

    if node is None or node.get("_partial_"):
        return
    if inspect.isfunction(get_object(node["_target_"])):
        raise ConfigError(f"{key}._target_ {node['_target_']} is a function: add "
                          f"`_partial_: true` so that it is passed to the DataLoader, not called "
                          f"once with no samples.")


def check_target_signature(key: str, node: Mapping[str, Any], **provided: Any) -> None:
    """Resolve `node['_target_']` and check its keyword arguments bind to its signature.

    Catches a renamed class or a misspelt argument before any work starts.
    """
    from hydra.utils import get_object

    target = node["_target_"]
    try:
        obj = get_object(target)
    except Exception as e:  # Hydra wraps ImportError/AttributeError in its own types
        moved = next((f" {old.rstrip('.')} moved: name it {new}{target[len(old):]}."
                      for old, new in MOVED.items() if target.startswith(old)), "")
        raise ConfigError(f"{key}._target_: cannot import '{target}' ({e}).{moved}") from None
    kwargs = {k: v for k, v in node.items() if not k.startswith("_")}
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return  # builtins without a signature: instantiate will report problems
    try:
        sig.bind_partial(**kwargs, **provided)
    except TypeError as e:
        raise ConfigError(
            f"{key}: {target} does not accept these arguments ({e}). "
            f"Accepted: {', '.join(sig.parameters)}."
        ) from None
    for name, value in kwargs.items():
        _check_type(f"{key}.{name}", value, sig.parameters.get(name), target)


def _check_type(key: str, value: Any, param: Optional[inspect.Parameter], target: str) -> None:
    """A string where the target's default is a number or a bool (optim.lr="3e-3"): refused
    naming the key, before torch compares it with a number deep inside the target."""
    default = None if param is None else param.default
    if param is None or not isinstance(value, str) or not isinstance(default, (bool, int, float)):
        return
    if any(word in str(param.annotation) for word in ("str", "Literal")):  # "auto", "all": valid
        return
    kind = "true or false" if isinstance(default, bool) else "a number"
    try:
        float(value)
        why = f"a string that looks like a number: write it unquoted ({key}={value})"
    except ValueError:
        why = f"not {kind}"
    raise ConfigError(f"{key} must be {kind} ({target}'s default is {default!r}); got the "
                      f"string {value!r}, {why}.")


def _positive(cfg: Any, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if isinstance(value, (int, float)) and value <= 0:  # other types: OmegaConf reports them
            raise ConfigError(f"trainer.{name} must be > 0, got {value}.")


def _positive_or_none(cfg: Any, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if isinstance(value, (int, float)) and value <= 0:
            raise ConfigError(f"trainer.{name} must be > 0 or null, got {value}.")


def _one_of(cfg: Any, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(cfg, name)
    if value not in choices:
        raise ConfigError(f"trainer.{name} must be one of {', '.join(choices)}; got {value!r}.")


# The loggers a config may name without `_target_` ({"mlflow": {...}} in Python).
# Here, not in saferun.loggers: a config is checked without importing torch (the command line's
# checks of a sweep's values, before any job).
NAMED_LOGGERS = {"tensorboard": "saferun.loggers.TensorBoardLogger",
                 "jsonl": "saferun.loggers.MetricsJsonl",
                 "mlflow": "saferun.loggers.trackers.MLflowLogger",
                 "wandb": "saferun.loggers.trackers.WandbLogger"}


def with_targets(given: Mapping[str, Any]) -> dict[str, Any]:
    """`given` logger nodes with the `_target_` of each known name that has none."""
    return {k: {"_target_": NAMED_LOGGERS[k], **v} if isinstance(v, Mapping) and k in NAMED_LOGGERS
            and "_target_" not in v else v for k, v in given.items()}


def chosen_loggers(given: Mapping[str, Any], merged: Mapping[str, Any],
                   defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The `logger` set of a config: `given` is the whole set (`{}`: none) unless a name in it
    maps to None; then it edits the defaults (`merged`: the defaults updated by it), as
    `logger.NAME=null` does on the command line. A None for a name that is not a default
    logger is refused: a misspelt removal would remove nothing, silently."""
    removed = {k for k, v in given.items() if v is None}
    if removed - set(defaults):
        raise ConfigError(f"logger: None removes a default logger ({', '.join(defaults)}), not "
                          f"{', '.join(sorted(removed - set(defaults)))}.")
    return {k: v for k, v in merged.items() if v is not None and (removed or k in given)}
