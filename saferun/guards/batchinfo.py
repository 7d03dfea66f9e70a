"""A batch described in the user's terms: its fields (`batch[0]`, `batch['image']`,
`batch.label`) with shape, dtype and device, and the fields and samples holding NaN/Inf."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Optional

import torch


def describe_batch(batch: Any, root: str = "batch", limit: int = 12) -> list[str]:
    """'batch[0]: float32 (32, 8) cpu' for each tensor (and 'name: type' for the rest)."""
    out = []
    for name, value in _leaves(batch, root):
        if isinstance(value, torch.Tensor):
            out.append(f"{name}: {str(value.dtype).replace('torch.', '')} "
                       f"{tuple(value.shape)} {value.device}")
        else:
            out.append(f"{name}: {type(value).__name__}")
        if len(out) == limit:
            out.append("...")
            break
    return out


def nonfinite_fields(batch: Any, indices: Optional[list[int]] = None) -> list[str]:
    """'batch[0] in samples [3, 17] (2 in all)' for each float field holding NaN or Inf
    (samples: positions along the first dimension, or dataset indices if given). One host
    read for all fields, one more per field that has them."""
    from ..text import short

    floats = [(n, t) for n, t in tensors(batch) if t.is_floating_point() and t.numel()]
    if not floats:
        return []
    device = floats[0][1].device
    finite = torch.stack([torch.isfinite(t).all().to(device) for _, t in floats]).tolist()
    found = []
    for (name, t), ok in zip(floats, finite):
        if ok:
            continue
        at = ((~torch.isfinite(t)).reshape(t.shape[0], -1).any(1).nonzero().flatten().tolist()
              if t.ndim else [])
        if indices is not None and t.ndim and len(indices) == t.shape[0]:
            at = [indices[i] for i in at]
        found.append(f"{name} in {'dataset ' if indices else ''}samples {short(at)}" if at else name)
    return found


def nonfinite_inputs(loader: Any, indices: list[int]) -> str:
    """After a non-finite step: do the step's samples already hold NaN/Inf? The sentence that
    says so (field, dataset indices), or ''. Fetched again from the dataset, only then."""
    dataset = getattr(loader, "dataset", None)
    if not indices or dataset is None or not hasattr(dataset, "__getitem__"):
        return ""
    try:
        batch = loader.collate_fn([dataset[i] for i in indices])
        bad = nonfinite_fields(batch, list(indices))
    except Exception:  # an odd dataset: no finding rather than a second error
        return ""
    if not bad:
        return ""
    return (f"the input data already holds NaN/Inf: {'; '.join(bad)}. The model is not at "
            f"fault: clean or filter those samples in the dataset (e.g. torch.nan_to_num, or "
            f"drop rows with missing values).")


def tensors(batch: Any, root: str = "batch") -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor in a nested batch (dicts, named tuples, lists, tuples,
    dataclasses)."""
    return [(n, v) for n, v in _leaves(batch, root) if isinstance(v, torch.Tensor)]


def _leaves(obj: Any, name: str) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, torch.Tensor):
        yield name, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, f"{name}[{k!r}]")
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):
        for k in obj._fields:
            yield from _leaves(getattr(obj, k), f"{name}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{name}[{i}]")
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _leaves(getattr(obj, f.name), f"{name}.{f.name}")
    else:
        yield name, obj


