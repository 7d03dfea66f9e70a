"""Checks an expert runs by hand on a new model and data, automated (issue 16).

At setup, once (no cost per step): a BatchNorm that the last batch of an epoch would give
a single sample, and a submodule frozen by hand (requires_grad=False) but not declared in
`trainer.frozen_modules`, whose BatchNorm statistics would drift. In `saferun check` (see
`guards/check.py`), bounded in time or steps: train/validation overlap, the loss at
initialisation, batch independence and an input-independent baseline.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, SequentialSampler

from ..loop.steps import short

log = logging.getLogger("saferun")

_NORMS = (nn.modules.batchnorm._BatchNorm,)
_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)


# ------------------------------------------------------------------ at setup

def setup_warnings(model: nn.Module, frozen: Sequence[nn.Module], t: Any, loader: Any,
                   world_size: int) -> list[str]:
    """Log (and return) the setup-time findings: see `last_batch_of_one`, `frozen_by_hand`,
    `fixed_order`."""
    found = [w for w in (last_batch_of_one(model, frozen, loader, world_size),
                         *frozen_by_hand(model, frozen), fixed_order(loader, t.shuffle)) if w]
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
    trainer.frozen_modules, holding BatchNorm or Dropout: training mode still updates the
    statistics (and drops units) of what the user meant to freeze."""
    declared = {id(m) for f in frozen for m in f.modules()}
    found, inside = [], set()
    for name, module in model.named_modules():
        if not name or id(module) in declared or id(module) in inside:
            continue
        params = list(module.parameters())
        if not params or any(p.requires_grad for p in params):
            continue
        moving = [f"{name}.{n}" if n else name for n, m in module.named_modules()
                  if isinstance(m, _NORMS + _DROPOUTS)]
        inside |= {id(m) for m in module.modules()}
        if moving:
            found.append(
                f"module '{name}' has every parameter frozen by hand (requires_grad=False) but is "
                f"not in trainer.frozen_modules, and holds {short(moving, 3)}: in training mode its "
                f"BatchNorm statistics keep changing (and Dropout stays on). Declare it, "
                f"trainer.frozen_modules=[{name}] (or `frozen_modules: [{name}]` in YAML), to "
                f"keep it in eval mode.")
    return found


# ------------------------------------------------------------------ in saferun check

def overlap(train: Dataset, val: Dataset, budget_s: float = 10.0) -> tuple[str, str]:
    """(status, finding): samples identical in both sets, by a hash of their tensors."""
    start = time.monotonic()
    seen: dict[bytes, int] = {}
    checked_train = _hash_into(train, seen, start, budget_s / 2)
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


def initial_loss_finding(loss: float, expected: Optional[tuple[float, int]]) -> tuple[str, str]:
    """(status, finding) for the loss of an untrained model on one batch."""
    if expected is None:
        return "pass", f"loss at initialisation {loss:.4g} (not a classification output: not compared)"
    ln_c, classes = expected
    if loss > 2.0 * ln_c + 1.0:
        return "warn", (f"loss at initialisation {loss:.4g}, far above ln({classes}) = "
                        f"{ln_c:.3g} that uniform predictions over {classes} classes give: "
                        f"the output layer is mis-scaled (large initial logits) or the targets "
                        f"are not what the loss expects")
    return "pass", f"loss at initialisation {loss:.4g} (ln({classes}) = {ln_c:.3g})"


def first_float_input(model: nn.Module, run: Callable[[], Any], batch_rows: int
                      ) -> tuple[Optional[torch.Tensor], Any]:
    """Run `run` once with a forward pre-hook that swaps the first float tensor (first dim
    `batch_rows`) entering any module for a leaf requiring grad: (that leaf, run's result)."""
    leaf: list[torch.Tensor] = []

    def swap(mod: nn.Module, args: Any) -> Any:
        if leaf or not args or not isinstance(args[0], torch.Tensor):
            return None
        x = args[0]
        if not x.is_floating_point() or x.ndim == 0 or x.shape[0] != batch_rows:
            return None
        leaf.append(x.detach().clone().requires_grad_(True))
        return (leaf[0], *args[1:])

    handles = [m.register_forward_pre_hook(swap) for m in model.modules()]
    try:
        out = run()
    finally:
        for h in handles:
            h.remove()
    return (leaf[0] if leaf else None), out


def batch_dependence(model: nn.Module, call: Callable[[], Any], rows: int) -> tuple[str, str]:
    """In eval mode, d(output of sample 0) / d(input of sample j) must be 0 for every j != 0."""
    x, out = first_float_input(model, call, rows)
    out = out[0] if isinstance(out, (tuple, list)) else out
    if x is None or not isinstance(out, torch.Tensor) or out.ndim == 0 or out.shape[0] != rows \
            or not out.requires_grad:
        return "pass", "no float input and per-sample output found: not checked"
    if rows < 2:
        return "pass", "a batch of one sample: not checked"
    (grad,) = torch.autograd.grad(out[0].float().sum(), x, allow_unused=True)
    if grad is None:
        return "pass", "the output of sample 0 does not depend on the input"
    mixed = (grad.reshape(rows, -1) != 0).any(1)
    mixed[0] = False
    others = mixed.nonzero().flatten().tolist()
    if others:
        return "fail", (f"in eval mode, sample 0's output depends on the input of samples "
                        f"{short(others, 8)} of the same batch: a reshape, view or transpose "
                        f"mixes the batch dimension (e.g. x.view(-1, batch) instead of "
                        f"x.view(batch, -1), or a softmax/mean over dim 0)")
    return "pass", f"samples are independent: sample 0's output depends only on its own input ({rows} per batch)"


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
    """A forward pre-hook on the model that replaces its first input with zeros (a handle);
    `calls[0]` counts the inputs it zeroed."""
    def zero(mod: nn.Module, args: Any) -> Any:
        if args and isinstance(args[0], torch.Tensor):
            calls[0] += 1
            return (torch.zeros_like(args[0]), *args[1:])
        return None
    return model.register_forward_pre_hook(zero)


# ------------------------------------------------------------------ saferun check: order, evaluation

def single_class_batches(batches: Sequence[Any]) -> tuple[str, str]:
    """(status, finding): do the first training batches each hold one class? The label field
    is the first integer vector with one entry per sample."""
    labels = [_label_field(b) for b in batches]
    if len(batches) < 2 or any(y is None for y in labels):
        return "pass", "no integer label field found in the first batches: not checked"
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
