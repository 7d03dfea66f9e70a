"""Checks an expert runs by hand on a new model and data, automated (issue 16).

At setup, once (no cost per step): a BatchNorm that the last batch of an epoch would give
a single sample, and a submodule frozen by hand (requires_grad=False) but not declared in
`trainer.frozen_modules`, whose BatchNorm statistics would drift. In `saferun check` (see
`check.py`), bounded in time or steps: train/validation overlap, the loss at
initialisation, batch independence and an input-independent baseline.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import logging
import math
import time
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, SequentialSampler

from ..text import short

log = logging.getLogger("saferun")

_NORMS = (nn.modules.batchnorm._BatchNorm,)
_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)


# ------------------------------------------------------------------ at setup

def setup_warnings(model: nn.Module, frozen: Sequence[nn.Module], t: Any, loader: Any,
                   world_size: int, val_loader: Any = None) -> list[str]:
    """Log (and return) the setup-time findings: see `last_batch_of_one`, `frozen_by_hand`,
    `fixed_order`, `evaluation_drops`."""
    found = [w for w in (last_batch_of_one(model, frozen, loader, world_size),
                         *frozen_by_hand(model, frozen), fixed_order(loader, t.shuffle),
                         evaluation_drops(val_loader, t.limit_val_batches is not None,
                                          world_size)) if w]
    for warning in found:
        log.warning("%s", warning)
    return found


def last_batch_of_one(model: nn.Module, frozen: Sequence[nn.Module], loader: Any,
                      world_size: int = 1) -> Optional[str]:
    """A BatchNorm in training and a last batch of one sample per epoch (on each rank)."""
    frozen_ids = {id(m) for f in frozen for m in f.modules()}
    norms = [n for n, m in model.named_modules() if isinstance(m, _NORMS) and id(m) not in frozen_ids]
    batches = getattr(loader, "batch_sampler", None)
    batches = getattr(batches, "batch_sampler", batches)  # inside saferun's IndexRecorder
    sampler, size = getattr(batches, "sampler", None), getattr(batches, "batch_size", None)
    if not norms or getattr(batches, "drop_last", True) or not size or not hasattr(sampler, "__len__"):
        return None
    n = len(sampler)  # type: ignore[arg-type]  # has __len__ (checked above); a DistributedSampler's length is this rank's share
    if n % size != 1:
        return None
    per_rank = f" per rank ({world_size} ranks)" if world_size > 1 else ""
    return (f"the last training batch of every epoch will hold one sample: {n} samples{per_rank} "
            f"% batch_size {size} == 1, and BatchNorm {short(norms, 3)} in training mode "
            f"cannot normalise one sample (BatchNorm1d raises; 2d statistics of one image are "
            f"noise). Set trainer.drop_last=true (or another trainer.batch_size).")


def evaluation_drops(loader: Any, limited: bool, world_size: int = 1) -> Optional[str]:
    """A validation loader that yields fewer samples than its map-style dataset holds (built
    with drop_last=True, or a sampler over part of it): the metrics silently leave samples
    out. `limited`: trainer.limit_val_batches is set (a cut asked for)."""
    if loader is None or limited or isinstance(loader.dataset, IterableDataset) \
            or not hasattr(loader.dataset, "__len__"):
        return None
    batches = getattr(loader, "batch_sampler", None)
    batches = getattr(batches, "batch_sampler", batches)  # inside saferun's IndexRecorder
    sampler, size = getattr(batches, "sampler", None), getattr(batches, "batch_size", None)
    if not hasattr(sampler, "__len__") or not size:
        return None
    per_rank = len(sampler)  # type: ignore[arg-type]  # has __len__ (checked above)
    dropped_last = per_rank % size if getattr(batches, "drop_last", False) else 0
    kept, n = (per_rank - dropped_last) * world_size, len(loader.dataset)
    if kept >= n:
        return None
    why = (f"drop_last=True drops the last {dropped_last} of each pass{' per rank' if world_size > 1 else ''}"
           if dropped_last else f"its sampler covers {per_rank * world_size} samples")
    return (f"the validation loader yields {kept} of the {n} samples of its "
            f"{type(loader.dataset).__name__} ({why}): every validation leaves {n - kept} out, "
            f"and the metrics are not the validation set's. Build it with drop_last=False over "
            f"every sample (trainer.limit_val_batches cuts it on purpose, saying so).")


def fixed_order(loader: Any, shuffle: bool) -> Optional[str]:
    """A training loader that reads a map-style dataset in index order (a DataLoader built
    with shuffle=False): the same order every epoch, and data sorted by class or source trains
    in blocks. `trainer.shuffle=false` says the order is intended (a curriculum): no warning."""
    if not shuffle or loader is None or isinstance(loader.dataset, IterableDataset):
        return None
    batches = getattr(loader, "batch_sampler", None)
    batches = getattr(batches, "batch_sampler", batches)  # inside saferun's IndexRecorder
    if type(getattr(batches, "sampler", None)) is not SequentialSampler:
        return None  # shuffled, or a sampler the user chose (weighted, distributed, their own)
    return (f"the training DataLoader reads its {type(loader.dataset).__name__} in index order "
            f"(a SequentialSampler: shuffle=False in build_dataloaders), the same order every "
            f"epoch; data sorted by class or source then trains in blocks. Build it with "
            f"shuffle=True (saferun seeds its order per epoch), or set trainer.shuffle=false to "
            f"say the order is intended (a curriculum).")


def frozen_by_hand(model: nn.Module, frozen: Sequence[nn.Module]) -> list[str]:
    """Submodules whose parameters all have requires_grad=False, not in
    trainer.frozen_modules, holding a BatchNorm that tracks running statistics: training
    mode still updates the statistics of what the user meant to freeze. (A Dropout alone is
    not named: a frozen backbone whose dropout stays on while adapters train is the usual
    fine-tuning, and eval mode would switch it off.)"""
    declared = {id(m) for f in frozen for m in f.modules()}
    found, inside = [], set()
    for name, module in model.named_modules():
        if not name or id(module) in declared or id(module) in inside:
            continue
        params = list(module.parameters())
        if not params or any(p.requires_grad for p in params):
            continue
        moving = [f"{name}.{n}" if n else name for n, m in module.named_modules()
                  if isinstance(m, _NORMS) and m.track_running_stats]
        inside |= {id(m) for m in module.modules()}
        if moving:
            found.append(
                f"module '{name}' has every parameter frozen by hand (requires_grad=False) but is "
                f"not in trainer.frozen_modules, and holds {short(moving, 3)}: in training mode its "
                f"BatchNorm running statistics keep changing. Declare it, "
                f"trainer.frozen_modules=[{name}] (or `frozen_modules: [{name}]` in YAML), to "
                f"keep it in eval mode.")
    return found


# ------------------------------------------------------------------ in saferun check

def overlap(train: Dataset, val: Dataset, budget_s: float = 10.0) -> tuple[str, str]:
    """(status, finding): samples identical in both sets, by a hash of their tensors."""
    start = time.monotonic()
    seen: dict[bytes, int] = {}
    checked_train = _hash_into(train, seen, start, budget_s / 2)
    if checked_train and 2 * len(seen) <= checked_train:
        # Low-cardinality inputs (single token ids, a few categories): equal samples across
        # the splits are expected, as within the training set itself.
        return "pass", (f"not checked, because the training set repeats its own samples "
                        f"({len(seen)} distinct of {checked_train} hashed): with so few distinct "
                        f"inputs, equal samples in both splits are expected, not a leak")
    hits, checked_val = [], 0
    for j in range(len(val)):  # type: ignore[arg-type]
        if time.monotonic() - start > budget_s:
            break
        key = _sample_hash(val[j])
        checked_val += 1
        if key in seen:
            hits.append((j, seen[key]))
    bounded = (f" (hashed the first {checked_train} of {len(train)} training and "  # type: ignore[arg-type]
               f"{checked_val} of {len(val)} validation samples, {budget_s:g} s budget)"  # type: ignore[arg-type]
               if checked_train < len(train) or checked_val < len(val) else "")  # type: ignore[arg-type]
    if hits:
        examples = ", ".join(f"val {j} = train {i}" for j, i in hits[:5])
        return "fail", (f"{len(hits)} validation samples are identical to training samples "
                        f"({examples}){bounded}: the validation score overstates "
                        f"generalisation. Split before augmenting and deduplicate.")
    return "pass", f"no validation sample equals a training sample{bounded}"


def _hash_into(data: Dataset, seen: dict[bytes, int], start: float, budget_s: float) -> int:
    count = 0
    for i in range(len(data)):  # type: ignore[arg-type]
        if time.monotonic() - start > budget_s:
            break
        seen.setdefault(_sample_hash(data[i]), i)
        count += 1
    return count


def _sample_hash(sample: Any) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for t in _flat(sample):
        if isinstance(t, torch.Tensor):
            t = t.detach().cpu().contiguous()
            h.update(str((t.dtype, tuple(t.shape))).encode())
            h.update(t.numpy().tobytes() if t.dtype != torch.bfloat16 else t.float().numpy().tobytes())
        else:
            h.update(repr(t).encode())
    return h.digest()


def _flat(obj: Any) -> list[Any]:
    if isinstance(obj, dict):
        return [x for k in sorted(obj, key=str) for x in _flat(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in _flat(v)]
    if hasattr(obj, "__array__") and not isinstance(obj, torch.Tensor):
        return [torch.as_tensor(obj)]
    return [obj]


def expected_initial_loss(batch: Any, output: torch.Tensor) -> Optional[tuple[float, int]]:
    """(ln C, C) if `output` looks like class scores (B, C) or (B, T, C) for integer targets
    in [0, C) found in the batch; else None (not a classification: not checked)."""
    if not output.is_floating_point() or output.ndim < 2 or output.shape[-1] < 2:
        return None
    classes = output.shape[-1]
    for t in _flat(batch):
        if isinstance(t, torch.Tensor) and not t.is_floating_point() and t.dtype != torch.bool \
                and t.shape[0] == output.shape[0] and t.numel() and \
                tuple(t.shape) == tuple(output.shape[:-1]) and \
                0 <= int(t.min()) and int(t.max()) < classes:
            return math.log(classes), classes
    return None


def scores(output: Any) -> Optional[torch.Tensor]:
    """The class scores of a model's output: the output itself, or the `logits` of a dict-like
    output (a Hugging Face ModelOutput); None if neither."""
    if isinstance(output, Mapping):
        output = output.get("logits")
    return output if isinstance(output, torch.Tensor) else None


def initial_loss_finding(loss: float, expected: Optional[tuple[float, int]],
                         raw_inputs: Optional[str] = None) -> tuple[str, str]:
    """(status, finding) for the loss of an untrained model on one batch; `raw_inputs`: the
    input's scale where it reaches the first weight layer, if far from unit (`unnormalised`),
    named as the cause before the output layer."""
    if raw_inputs is not None:
        far = (f" (loss at initialisation {loss:.4g}, ln({expected[1]}) = {expected[0]:.3g})"
               if expected is not None else f" (loss at initialisation {loss:.4g})")
        return "warn", (f"{raw_inputs}: unnormalised inputs{far} make the first layer's outputs "
                        f"and gradients huge and the learning rate wrong for them. Normalise the "
                        f"inputs in the dataset's transform (images: x / 255, then the mean and "
                        f"std per channel; features: standardise each).")
    if expected is None:
        return "pass", f"loss at initialisation {loss:.4g} (not a classification output: not compared)"
    ln_c, classes = expected
    if loss > 2.0 * ln_c + 1.0:
        return "warn", (f"loss at initialisation {loss:.4g}, far above ln({classes}) = "
                        f"{ln_c:.3g} that uniform predictions over {classes} classes give: "
                        f"the output layer is mis-scaled (large initial logits) or the targets "
                        f"are not what the loss expects")
    return "pass", f"loss at initialisation {loss:.4g} (ln({classes}) = {ln_c:.3g})"


_WEIGHT_LAYERS = (nn.Linear, nn.modules.conv._ConvNd)
RAW_STD = 10.0  # an input's standard deviation past which it is not normalised


@contextlib.contextmanager
def first_layer_input(model: nn.Module, rows: int) -> Iterator[list[tuple[str, float, float]]]:
    """Inside: records (module name, std, largest magnitude) of the first float input with one
    row per sample that enters a Linear or convolution: what the model's first weight layer
    sees of the data."""
    seen: list[tuple[str, float, float]] = []
    names = {id(m): n for n, m in model.named_modules()}

    def look(mod: nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0] if args else None
        if not seen and isinstance(x, torch.Tensor) and x.is_floating_point() and x.ndim >= 1 \
                and x.shape[0] == rows and x.numel() > 1:
            x = x.detach().float()
            seen.append((names[id(mod)], float(x.std()), float(x.abs().max())))

    handles = [m.register_forward_pre_hook(look) for m in model.modules()
               if isinstance(m, _WEIGHT_LAYERS)]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def unnormalised(seen: Sequence[tuple[str, float, float]]) -> Optional[str]:
    """Where raw inputs reach the first weight layer, said in a phrase; None if they are of
    unit scale."""
    if not seen or not seen[0][1] > RAW_STD:
        return None
    name, std, top = seen[0]
    return (f"the inputs reach the model's first weight layer '{name}' with a standard "
            f"deviation of {std:.3g} (values up to {top:.4g})")


class _Stop(BaseException):
    """Raised by `model_call`'s hook: the model's arguments are known, the call need not run
    (a BaseException, so that a training_step's `except Exception` does not swallow it)."""


def model_call(model: nn.Module, step: Callable[[], Any]) -> Optional[tuple[tuple[Any, ...], dict[str, Any]]]:
    """The arguments `step` (training_step on one batch) passes to `model` itself, positional
    and keyword (`model(**batch)`, as Hugging Face users call it), or None if it calls only
    submodules. The step stops at the model's call: nothing runs, nothing trains."""
    seen: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def grab(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen.append((args, kwargs))
        raise _Stop

    handle = model.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        step()
    except _Stop:
        pass
    finally:
        handle.remove()
    return seen[0] if seen else None


def per_sample_output(out: Any, rows: int) -> tuple[Optional[torch.Tensor], str]:
    """The model output whose row 0 is sample 0's: `logits` of a dict-like output (a Hugging
    Face ModelOutput), else its first tensor with `rows` rows; a (rows, rows) output compares
    the samples with each other (contrastive scores) and is taken only if nothing else is.
    (tensor, its name) or (None, why not)."""
    if isinstance(out, Mapping):
        named = sorted(out.items(), key=lambda kv: kv[0] != "logits")
    elif isinstance(out, (tuple, list)):
        named = [(f"output[{i}]", v) for i, v in enumerate(out)]
    else:
        named = [("output", out)]
    found = [(k, v) for k, v in named if isinstance(v, torch.Tensor) and v.ndim >= 1
             and v.shape[0] == rows and v.is_floating_point() and v.requires_grad]
    own = [(k, v) for k, v in found if tuple(v.shape) != (rows, rows)]
    if own:
        return own[0][1], str(own[0][0])
    if found:
        return None, (f"the output {found[0][0]} is {rows} x {rows}, scores of each sample "
                      f"against every other (contrastive): it depends on the whole batch by design")
    return None, "no float output with one row per sample found"


def rolled(tree: Any, rows: int) -> Any:
    """`tree` (a batch, a model's arguments) with every tensor of `rows` rows rolled by one
    along dim 0: each sample moves to the next row."""
    if isinstance(tree, torch.Tensor):
        return tree.roll(1, 0) if tree.ndim >= 1 and tree.shape[0] == rows else tree
    if isinstance(tree, Mapping):
        items = {k: rolled(v, rows) for k, v in tree.items()}
        return items if type(tree) is dict else type(tree)(items)  # type: ignore[call-arg]  # a Mapping subclass built from a dict (a ModelOutput, BatchEncoding)
    if isinstance(tree, (tuple, list)):
        return type(tree)(rolled(v, rows) for v in tree)
    return tree


def batch_dependence(model: nn.Module, call: Callable[[bool], Any], rows: int) -> tuple[str, str]:
    """In eval mode, d(output of sample 0) / d(input of sample j) must be 0 for every j != 0.
    `call(roll)`: the model's output on the batch, its samples rolled by one row if `roll`.

    Every tensor with one row per sample that enters or leaves a module gets a zero added that
    requires grad; the gradient of sample 0's output with respect to each zero says whether that
    point reaches the output (else it tests nothing) and whether other samples' rows there
    reach sample 0's. A module whose input rows mix but whose output rows do not is where the
    batch gets mixed. A tensor that merely has as many rows as the batch (a position bias of
    as many positions, a constant) is told apart by a second forward with the samples rolled
    by one row: it stays the same, so it is not a point."""
    if rows < 2:
        return "pass", "a batch of one sample: not checked"
    names = {id(m): n for n, m in model.named_modules()}
    points: list[tuple[tuple[str, str, int], torch.Tensor]] = []  # ((module, in/out, nth), zero)
    values: list[dict[tuple[str, str, int], torch.Tensor]] = [{}, {}]
    order: list[str] = []
    run = [0]

    def zero_added(x: Any, where: str, mod: nn.Module) -> tuple[bool, Any]:
        """(whether x is a point, x with a zero leaf added in the first run)."""
        if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.ndim >= 1
                and x.shape[0] == rows):
            return False, None
        seen = values[run[0]]
        key = (names[id(mod)], where, sum(k[:2] == (names[id(mod)], where) for k in seen))
        seen[key] = x.detach().clone()
        if run[0]:
            return True, None
        z = torch.zeros_like(x, requires_grad=True)
        points.append((key, z))
        return True, x + z

    def enter(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        order.append(names[id(mod)])
        for i, a in enumerate(args):
            found, new = zero_added(a, "input", mod)
            if found:
                return None if new is None else ((*args[:i], new, *args[i + 1:]), kwargs)
        for k, v in kwargs.items():
            found, new = zero_added(v, "input", mod)
            if found:
                return None if new is None else (args, {**kwargs, k: new})
        return None

    def leave(mod: nn.Module, args: Any, out: Any) -> Any:
        if isinstance(out, tuple) and not hasattr(out, "_fields") and out:
            new = zero_added(out[0], "output", mod)[1]
            return None if new is None else (new, *out[1:])
        return zero_added(out, "output", mod)[1]

    handles = [m.register_forward_pre_hook(enter, with_kwargs=True) for m in model.modules()]
    handles += [m.register_forward_hook(leave) for m in model.modules()]
    try:
        result = call(False)
        run[0] = 1
        with torch.no_grad():
            call(True)
    finally:
        for h in handles:
            h.remove()
    out, what = per_sample_output(result, rows)
    if out is None:
        return "pass", f"not checked, because {what}"
    grads = torch.autograd.grad(out[0].float().sum(), [z for _, z in points], allow_unused=True)
    reached = [(key, g) for (key, _), g in zip(points, grads)
               if g is not None and not _shared(key, values)]
    if not reached:
        return "pass", (f"not checked, because nothing that follows the batch's samples inside "
                        f"the model reaches sample 0's {what}")
    mixes = {key: _other_rows(g, rows) for key, g in reached}
    mixers = {m for (m, w, n), others in mixes.items()
              if w == "input" and others and not mixes.get((m, "output", n), [1])}
    innermost = [m for m in mixers if not any(o != m and (m == "" or o.startswith(m + "."))
                                              for o in mixers)]
    modules = dict(model.named_modules())
    by_design = [m for m in innermost if _batch_statistics(modules[m])]
    others = sorted({j for v in mixes.values() for j in v})
    if others and (set(innermost) - set(by_design) or not innermost):
        blamed = [m for m in innermost if m not in by_design]
        where = (f"module {', '.join(repr(m or '(model)') for m in blamed[:3])} mixes the rows "
                 f"of its input (its own forward code, outside its submodules)" if blamed else
                 f"the batch is mixed after {_first(reached, order)}")
        return "fail", (f"in eval mode, sample 0's {what} depends on the input of samples "
                        f"{short(others, 8)} of the same batch: {where}. A reshape, view or "
                        f"transpose mixes the batch dimension (e.g. x.view(-1, batch) instead "
                        f"of x.view(batch, -1), or a softmax/mean over dim 0)")
    traced = _first(reached, order)
    if others:
        return "pass", (f"samples depend on each other only through "
                        f"{', '.join(repr(m) for m in by_design[:3])}, which normalise with the "
                        f"batch's statistics in eval mode too (track_running_stats=False): by "
                        f"design; nothing else mixes the batch (traced from {traced}, {rows} "
                        f"per batch)")
    return "pass", (f"samples are independent: sample 0's {what} depends only on its own row "
                    f"at every point from {traced} on ({rows} per batch)")


def _shared(key: tuple[str, str, int], values: list[dict[Any, torch.Tensor]]) -> bool:
    """A tensor unchanged when the batch's samples were rolled: it does not follow the samples
    (a position bias with as many rows as the batch, a constant), so it tests nothing."""
    a, b = values[0].get(key), values[1].get(key)
    return a is not None and b is not None and a.shape == b.shape and bool(torch.equal(a, b))


def _other_rows(grad: torch.Tensor, rows: int) -> list[int]:
    mixed = (grad.reshape(rows, -1) != 0).any(1)
    mixed[0] = False
    return mixed.nonzero().flatten().tolist()


def _batch_statistics(module: nn.Module) -> bool:
    """A norm that uses the batch's statistics in eval mode too (by its configuration)."""
    return isinstance(module, _NORMS) and not module.track_running_stats


def _first(reached: Sequence[tuple[tuple[str, str, int], Any]], order: Sequence[str]) -> str:
    """The point that reaches the output nearest to the model's input (first entered)."""
    first = {m: i for i, m in reversed(list(enumerate(order)))}
    m, w, _ = min((key for key, _ in reached), key=lambda k: (first.get(k[0], 0), k[1] != "input", k[2]))
    return f"the {w} of module {m or '(model)'!r}"


def baseline_finding(real: float, zeroed: float, starts: tuple[float, float], steps: int
                     ) -> tuple[str, str]:
    """(status, finding) comparing the eval-mode loss on one batch fitted for `steps` steps
    with its real inputs and with them zeroed (`starts`: both losses before fitting)."""
    # A model that ignores its inputs gives the very same loss both times (same seed, same
    # batch, eval mode); one that uses them fits the batch further than the targets' average.
    if math.isclose(real, zeroed, rel_tol=1e-6, abs_tol=1e-12):
        return "warn", (f"fitting one batch for {steps} steps, the model got to a loss of "
                        f"{real:.4g} on its real inputs and {zeroed:.4g} with all inputs zeroed: "
                        f"it does not seem to use its inputs (inputs detached, overwritten, or "
                        f"not passed to the model)")
    if not real < 0.99 * zeroed:  # the output depends on the inputs; too few steps to say more
        return "skip", (f"inconclusive: the output depends on the inputs, but in {steps} steps "
                        f"on one batch the loss moved too little to show that they help "
                        f"(real inputs {starts[0]:.4g} -> {real:.4g}, zeroed {starts[1]:.4g} -> "
                        f"{zeroed:.4g}): a learning rate still warming up or small, or a loss "
                        f"with small gradients (Huber)")
    return "pass", (f"one batch, {steps} steps: real inputs {real:.4g}, below zeroed "
                    f"inputs {zeroed:.4g}")


def zeroing_inputs(model: nn.Module, calls: list[int]) -> Any:
    """A forward pre-hook on the model that replaces its first input with zeros (a handle):
    the first positional argument, or, for a call with keyword arguments only
    (`model(**batch)`), the one bound to the first parameter of `forward` (`input_ids`,
    `pixel_values`), never a target such as `labels`. `calls[0]` counts the inputs it zeroed."""
    params = list(inspect.signature(model.forward).parameters)

    def zero(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if args and isinstance(args[0], torch.Tensor):
            calls[0] += 1
            return (torch.zeros_like(args[0]), *args[1:]), kwargs
        first = next((p for p in params if kwargs.get(p) is not None), None)
        if not args and first is not None and isinstance(kwargs[first], torch.Tensor):
            calls[0] += 1
            return args, {**kwargs, first: torch.zeros_like(kwargs[first])}
        return None
    return model.register_forward_pre_hook(zero, with_kwargs=True)


# ------------------------------------------------------------------ saferun check: order, evaluation

def single_class_batches(batches: Sequence[Any]) -> tuple[str, str]:
    """(status, finding): do the first training batches each hold one class? The label field
    is the first integer vector with one entry per sample."""
    labels = [_label_field(b) for b in batches]
    if len(batches) < 2 or any(y is None for y in labels):
        return "pass", "no integer label field found in the first batches: not checked"
    if all(len(y) < 2 for y in labels):  # type: ignore[arg-type]  # None ruled out above
        return "pass", ("not checked, because the batches hold one sample each (a batch of one "
                        "holds one class whatever the order)")
    per_batch = [sorted(set(y.tolist())) for y in labels]  # type: ignore[union-attr]
    single = [c[0] for c in per_batch if len(c) == 1]
    if 4 * len(single) >= 3 * len(per_batch) and len(set(single)) > 1:
        shown = ", ".join(f"batch {i}: {'all ' + str(c[0]) if len(c) == 1 else 'mixed'}"
                          for i, c in enumerate(per_batch[:4]))
        return "warn", (f"{len(single)} of the first {len(batches)} training batches each hold a "
                        f"single class ({shown}, ...): the data reaches the loader sorted by "
                        f"label, so each step pushes the model toward one class. Shuffle the "
                        f"training data (DataLoader(shuffle=True)), or set trainer.shuffle=false "
                        f"if the order is intended.")
    return "pass", f"the first {len(batches)} training batches mix classes"


def _label_field(batch: Any) -> Optional[torch.Tensor]:
    found = _flat(batch)
    floats = [t for t in found if isinstance(t, torch.Tensor) and t.dim() >= 1]
    rows = floats[0].shape[0] if floats else None
    for t in found:
        if isinstance(t, torch.Tensor) and t.dim() == 1 and not t.is_floating_point() \
                and t.dtype != torch.bool and t.shape[0] == rows:
            return t
    return None


def nondeterministic_module(model: nn.Module, call: Callable[[], Any]) -> Optional[str]:
    """Run `call` twice (eval mode, no reseeding between) and name where the outputs first
    differ: a module whose output changed for the same input, or the forward code that feeds a
    module a different input (a random op written in forward). None if both runs agree."""
    names = {id(m): (n or "(model)", type(m).__name__) for n, m in model.named_modules()}
    runs: list[list[tuple[str, Optional[str], Any, Any]]] = []

    def record() -> list[tuple[str, Optional[str], Any, Any]]:
        seen: list[tuple[str, Optional[str], Any, Any]] = []
        stack: list[str] = []

        def enter(mod: nn.Module, args: Any) -> None:
            stack.append("'%s' (%s)" % names[id(mod)])

        def leave(mod: nn.Module, args: Any, out: Any) -> None:
            me = stack.pop()
            seen.append((me, stack[-1] if stack else None, _flat(args), _flat(out)))

        handles = [m.register_forward_pre_hook(enter) for m in model.modules()]
        handles += [m.register_forward_hook(leave) for m in model.modules()]
        try:
            call()
        finally:
            for h in handles:
                h.remove()
        return seen

    runs = [record(), record()]
    for (name, parent, args, out), (_, _, args2, out2) in zip(*runs):
        if not _all_equal(out, out2):
            if _all_equal(args, args2):
                return (f"module {name} gave different outputs for the same input in two "
                        f"evaluations in eval mode: it draws randomness that eval mode does not "
                        f"turn off (F.dropout(..., training=True) or a noise op written into its "
                        f"forward). Use self.training (F.dropout(x, p, training=self.training)) "
                        f"or an nn.Dropout module.")
            return (f"module {name} got a different input in two evaluations of the same batch in "
                    f"eval mode: a random operation in the forward code of {parent or 'the step'} "
                    f"before it calls {name} (F.dropout(..., training=True), torch.rand*) is "
                    f"still active. Make it depend on self.training.")
    return None


def _all_equal(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        (x.shape == y.shape and bool(torch.equal(x, y))) if isinstance(x, torch.Tensor)
        and isinstance(y, torch.Tensor) else True for x, y in zip(a, b))
