"""Stateful validation metrics (torchmetrics): AUROC, F1, per-class accuracy, anything that is
not a mean of per-batch values.

A Trainer declares them (`build_metrics`, or the `metrics` config nodes); `validation_step`
updates them; the Evaluator resets them before each validation pass and computes them after
it, on every rank (torchmetrics gathers the ranks' states inside `compute`: a collective, once
per validation). The computed values ride along with the batch-weighted means' one host read.

Their state lives only inside one validation pass (reset before it, computed after it), so a
checkpoint needs none of it: the computed values are kept with the loop's metrics, and a run
resumed from a stop during validation redoes that validation from the start.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import SaferunError
from .. import distributed


def prepared_metrics(metrics: Any, device: torch.device, configured: Any = None
                     ) -> dict[str, Any]:
    """Check `build_metrics()`'s result and move each metric to `device`. `configured`: the
    `metrics` config nodes, each of which must have been built (an override of build_metrics
    that ignores them would drop `+metrics.NAME...` from the command line without a word)."""
    missing = [str(k) for k, node in (configured or {}).items() if node and k not in (metrics or {})]
    if missing:
        raise SaferunError(
            f"the config sets metrics.{missing[0]}, but build_metrics() returned "
            f"{sorted(metrics or {}) or 'no metrics'}: this Trainer overrides build_metrics, and "
            f"its override decides the metrics, so {', '.join('val/' + m for m in missing)} would "
            f"never be reported. Merge the configured ones in the override (return "
            f"{{**super().build_metrics(), ...}}) and update every metric in validation_step "
            f"(for m in self.metrics.values(): m.update(...)), or remove metrics.{missing[0]}.")
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise SaferunError(f"build_metrics() must return a dict {{name: torchmetrics.Metric}}, "
                           f"got {type(metrics).__name__}.")
    prepared = {}
    for name, metric in metrics.items():
        if not all(callable(getattr(metric, m, None)) for m in ("update", "compute", "reset", "to")):
            raise SaferunError(
                f"metric {name!r} is a {type(metric).__name__}, not a torchmetrics.Metric (it needs "
                f"update, compute, reset and to). Return e.g. {{'f1': MulticlassF1Score(10, "
                f"average='macro')}} from build_metrics(), or use a metrics.{name}._target_ node.")
        if getattr(metric, "sync_on_compute", True) is False and distributed.ranks_from_env().world_size > 1:
            # each rank would compute its own shard's value: save_best and early stopping
            # would then decide differently on different ranks (and hang)
            raise SaferunError(f"metric {name!r} has sync_on_compute=False: under torchrun each "
                               f"rank would report only its own shard. Leave it at True.")
        prepared[str(name)] = metric.to(device)
    return prepared


def reset_all(metrics: Mapping[str, Any]) -> None:
    for metric in metrics.values():
        metric.reset()


def compute_all(metrics: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Every metric's value over the whole pass (all ranks), as 0-d tensors on the device, no host
    read: a 1-D result becomes name/0, name/1, ...; a dict result name/key."""
    values: dict[str, torch.Tensor] = {}
    for name, metric in metrics.items():
        if not getattr(metric, "update_called", True):  # torchmetrics would report a default 0
            raise SaferunError(
                f"metric {name!r} was never updated during validation, so it has no value "
                f"(torchmetrics would report its default, e.g. 0.0). Call "
                f"self.metrics[{name!r}].update(preds, target) in validation_step.")
        _flatten(name, metric.compute(), values)
    return values


def _flatten(name: str, value: Any, into: dict[str, torch.Tensor]) -> None:
    if isinstance(value, Mapping):
        for key, v in value.items():
            _flatten(f"{name}/{key}", v, into)
    elif isinstance(value, torch.Tensor) and value.ndim <= 1:
        if value.ndim == 0:
            into[name] = value.detach().float()
        else:
            into.update({f"{name}/{i}": v for i, v in enumerate(value.detach().float().unbind())})
    else:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise SaferunError(f"metric {name!r} computed {shape}: saferun logs scalars, vectors "
                           f"(one value per class) and dicts of them. Curves (ROC, PR) are not "
                           f"logged: report their area (AUROC, AveragePrecision) instead.")
