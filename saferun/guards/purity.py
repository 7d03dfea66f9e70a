"""Eval purity: evaluation must leave every parameter and buffer as it found them.

`fingerprint(model)` takes a checksum of each parameter and buffer on its own
device, without reading anything back to the host; `diff(before, after)`
compares two fingerprints with one host read and names each tensor that
changed, with its module and the likely cause. The checksums run over the
tensors' bit patterns, so NaN compares equal to NaN and any change of any
single element is seen.

`find_inference_tensors(model)` finds tensors that evaluation under
`torch.inference_mode()` left on the model (as parameters, buffers or plain
attributes): the next training step that saves one for backward fails with
torch's bare "Inference tensors cannot be saved for backward".
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from torch import nn

from ..errors import SaferunError

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 24  # elements per sum (even, so odd positions stay odd in every chunk)
_BN_STATS = ("running_mean", "running_var", "num_batches_tracked")


@dataclass(frozen=True)
class Fingerprint:
    """Checksums of a module's parameters and buffers, still on the device.

    Row i of `sums` is (sum of bit patterns, sum over odd positions) of tensor
    `names[i]`, a `kinds[i]` ("parameter" or "buffer") of a module of class
    `owners[i]`; `layouts[i]` is its dtype and shape.
    """

    names: tuple[str, ...]
    kinds: tuple[str, ...]
    owners: tuple[type, ...]
    layouts: tuple[str, ...]
    sums: Optional[torch.Tensor]  # (N, 2) int64, or None for a module without tensors
    # plain attributes holding a forward's output with its graph (a KL term, attention weights
    # kept to look at): each forward, training's too, writes them anew
    outputs: frozenset[str] = frozenset()
    # path -> a weak reference to each plain tensor attribute (not an inference tensor): one
    # that evaluation binds anew was written by training's forward too (a detached copy of an
    # output kept to look at, `self.last = y.detach()`): the next training forward writes it
    # anew as well (weak: an id could be reused by the new tensor once the old one is freed)
    attributes: tuple[tuple[str, "weakref.ref[torch.Tensor]"], ...] = ()


def fingerprint(module: nn.Module) -> Fingerprint:
    """Checksum every parameter and buffer of `module` on its device; no host sync."""
    names, kinds, owners, layouts, rows = [], [], [], [], []
    for kind, name, owner, t in _named_tensors(module):
        names.append(name)
        kinds.append(kind)
        owners.append(type(owner))
        layouts.append(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}")
        rows.append(_checksum(t))
    sums = None
    if rows:
        device = rows[0].device
        sums = torch.stack([r.to(device, non_blocking=True) for r in rows])
    held = list(_attribute_tensors(module))
    outputs = frozenset(path for path, t in held if t.grad_fn is not None)
    attributes = tuple((path, weakref.ref(t)) for path, t in held if not t.is_inference())
    return Fingerprint(tuple(names), tuple(kinds), tuple(owners), tuple(layouts), sums, outputs,
                       attributes)


def rewritten(before: Fingerprint, module: nn.Module) -> frozenset[str]:
    """The plain attributes that held a tensor before an evaluation and a new one after it: a
    forward writes them each call (training's too), so they are its outputs, not state."""
    refs = dict(before.attributes)
    return frozenset(path for path, t in _attribute_tensors(module)
                     if path in refs and refs[path]() is not t)


def diff(before: Fingerprint, after: Fingerprint) -> list[str]:
    """Describe each tensor that differs between two fingerprints; one host read."""
    changes = []
    index = {n: i for i, n in enumerate(before.names)}
    pairs = [(index[n], j) for j, n in enumerate(after.names) if n in index]
    if pairs:
        assert before.sums is not None and after.sums is not None
        if before.names == after.names:
            b, a = before.sums, after.sums.to(before.sums.device)
        else:
            b = torch.stack([before.sums[i] for i, _ in pairs])
            a = torch.stack([after.sums[j] for _, j in pairs]).to(b.device)
        changed = (a != b).any(dim=1).tolist()  # the one host read
        for (i, j), is_changed in zip(pairs, changed):
            if is_changed or before.layouts[i] != after.layouts[j]:
                changes.append(_explain(after, j, before.layouts[i]))
    after_names = set(after.names)
    for i, n in enumerate(before.names):
        if n not in after_names:
            changes.append(f"{before.kinds[i]} {n} ({before.owners[i].__name__}) was removed "
                           f"(or set to None) during evaluation")
    for j, n in enumerate(after.names):
        if n not in index:
            changes.append(f"{after.kinds[j]} {n} ({after.owners[j].__name__}) was added "
                           f"during evaluation: register buffers in __init__, and write them "
                           f"only when self.training is True")
    return changes


def changed(before: Fingerprint, after: Fingerprint) -> torch.Tensor:
    """A 0-dim bool device tensor: did anything change? No host sync, so the caller can read
    it together with its own values and call `diff` only when it is True."""
    if before.names != after.names or before.layouts != after.layouts or before.sums is None:
        return torch.tensor(before.names != after.names or before.layouts != after.layouts)
    assert after.sums is not None
    return (before.sums != after.sums.to(before.sums.device)).any()


def find_inference_tensors(module: nn.Module, outputs: frozenset[str] = frozenset()) -> list[str]:
    """Name every inference tensor held by `module`'s submodules, with the fix.

    Looks at parameters, buffers and plain attributes, including tensors in lists, tuples and
    dicts up to two levels deep, but not the attributes in `outputs` (forward outputs, which
    the next training forward writes anew). Reads only metadata.
    """
    found = []
    for mod_name, mod in module.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        owner = type(mod).__name__
        for key, value in vars(mod).items():
            if key == "_modules":
                continue
            if key in ("_parameters", "_buffers"):
                kind = "parameter" if key == "_parameters" else "buffer"
                items = [(f"{prefix}{k}", v) for k, v in value.items()]
            else:
                kind = "attribute"
                items = [(p, v) for p, v in _nested(f"{prefix}{key}", value, 2) if p not in outputs]
            found += [_inference_message(path, owner, kind) for path, t in items
                      if isinstance(t, torch.Tensor) and t.is_inference()]
    return found


def _attribute_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) of the tensors `module`'s submodules hold as plain attributes (in lists,
    tuples and dicts up to two levels deep)."""
    for mod_name, mod in module.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for key, value in vars(mod).items():
            if key not in ("_modules", "_parameters", "_buffers"):
                yield from ((p, t) for p, t in _nested(f"{prefix}{key}", value, 2)
                            if isinstance(t, torch.Tensor))


def _named_tensors(module: nn.Module) -> Iterator[tuple[str, str, nn.Module, torch.Tensor]]:
    for mod_name, mod in module.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for kind, table in (("parameter", mod._parameters), ("buffer", mod._buffers)):
            for name, t in table.items():
                if t is not None and not isinstance(t, nn.parameter.UninitializedTensorMixin):  # type: ignore[attr-defined]  # not in the stubs
                    yield kind, prefix + name, mod, t


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """(sum of all bit patterns, sum over odd positions) as an int64 pair on t's device.

    The sums wrap around in 32 bits (64 for 8-byte dtypes), so any change of
    one element changes the first, and a value moving between an even and an
    odd position changes the second. A permutation within the even (or the
    odd) positions is what they cannot see; weighting every position would
    cost about 20 times more on the CPU.
    """
    t = t.detach()
    if hasattr(t, "to_local"):  # a DTensor (FSDP): this rank's shard; flags summed over ranks
        t = t.to_local()
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.is_complex():
        t = torch.view_as_real(t)
    bits = t.view(_BITS[t.element_size()]).reshape(-1)
    acc = torch.int64 if t.element_size() == 8 else torch.int32
    total = torch.zeros(2, dtype=acc, device=t.device)
    for start in range(0, bits.numel(), _CHUNK):  # narrow dtypes are widened a chunk at a time
        chunk = bits[start:start + _CHUNK]
        total += torch.stack([chunk.sum(dtype=acc), chunk[1::2].sum(dtype=acc)])
    return total.to(torch.int64)


def _explain(fp: Fingerprint, j: int, old_layout: str) -> str:
    name, kind, owner = fp.names[j], fp.kinds[j], fp.owners[j]
    what = f"{kind} {name} ({owner.__name__}) changed during evaluation"
    if fp.layouts[j] != old_layout:
        what += f" (from {old_layout} to {fp.layouts[j]})"
    if issubclass(owner, nn.modules.batchnorm._NormBase) and name.rsplit(".", 1)[-1] in _BN_STATS:
        return (f"{what}: a BatchNorm in train mode updates its running statistics, even under "
                f"no_grad or inference_mode. Look for .train() or .training = True in forward "
                f"or validation_step.")
    if kind == "parameter":
        return (f"{what}: look for an optimizer step or an in-place write (p.data, p.copy_, "
                f"p.add_) in validation_step or forward.")
    return (f"{what}: the module writes it in forward even in eval mode. Update it only when "
            f"self.training is True, or keep per-evaluation state outside the model.")


def _nested(path: str, value: Any, depth: int) -> Iterator[tuple[str, Any]]:
    yield path, value
    if depth == 0:
        return
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _nested(f"{path}[{k!r}]", v, depth - 1)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _nested(f"{path}[{i}]", v, depth - 1)


def _inference_message(path: str, owner: str, kind: str) -> str:
    head = (f"{kind} {path} ({owner}) is an inference tensor: it was created under "
            f"torch.inference_mode(), and a training step that saves it for backward fails "
            f"with 'Inference tensors cannot be saved for backward'.")
    if kind == "parameter":
        return f"{head} Build the model outside torch.inference_mode()."
    return (f"{head} Store a .clone() made outside inference mode (or recompute it in "
            f"training), or set trainer.eval_grad_mode=no_grad.")


def check_purity(before: Optional[Fingerprint], model: nn.Module, changed: float,
                 eval_grad_mode: str, step: int) -> None:
    """guards.eval_purity: raise naming what evaluation changed or left on the model.
    `changed`: the host value of `changed(before, fingerprint(model))` (read with the metrics)."""
    if before is None:
        return
    problems = diff(before, fingerprint(model)) if changed else []
    if changed and not problems:  # the flag is summed over ranks: another rank's model changed
        problems = ["not on this rank, but on another rank (its error names what changed); "
                    "every rank stops, as their models now differ"]
    if eval_grad_mode == "inference_mode":
        # not the attributes that held a forward's output before (training writes them anew)
        problems += find_inference_tensors(  # metadata only: no sync
            model, before.outputs | rewritten(before, model))
    if problems:
        raise SaferunError(
            f"evaluation changed the model (guards.eval_purity), at step {step}:\n"
            + "\n".join(f"  - {p}" for p in problems) + "\nEvaluation must leave parameters "
            "and buffers as it found them; a module that changes state in eval mode makes "
            "validation results and later training depend on how often you validate.")
