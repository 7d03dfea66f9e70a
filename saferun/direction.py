"""Which direction of a validation metric is better: the one a setting gives, else the one its
well-known name says (val/loss: lower, val/acc: higher). One rule for trainer.save_best,
EarlyStopping and a sweep's objective; a name it does not know is refused, naming the setting
that says it: a guessed direction would keep the worst weights without a word."""

from __future__ import annotations

import re
from typing import Optional

from .errors import ConfigError

MODES = ("min", "max")
# A name component (split at anything but letters and digits; trailing digits dropped:
# map50, bleu4) that says the direction. Whole components only: val/mape is an error, val/map
# a precision.
LOWER = frozenset({"loss", "error", "err", "mse", "rmse", "mae", "mape", "smape", "nll",
                   "perplexity", "ppl", "wer", "cer"})
HIGHER = frozenset({"acc", "accuracy", "f1", "auc", "auroc", "r2", "precision", "recall", "bleu",
                    "rouge", "map", "ap", "iou", "miou", "dice"})
# Components that turn or blur the direction of the rest (val/neg_loss, val/acc_std): no guess.
UNSURE = frozenset({"neg", "negative", "minus", "inv", "inverse", "delta", "diff", "gap", "std",
                    "var", "change"})


def infer_mode(metric: str) -> Optional[tuple[str, str]]:
    """(mode, the name component that says it) from a well-known name, else None (unknown, or
    components pointing both ways)."""
    found: dict[str, str] = {}
    for part in re.split(r"[^a-z0-9]+", metric.lower()):
        if part in UNSURE:
            return None
        for word in (part, part.rstrip("0123456789")):
            if word in LOWER or word in HIGHER:
                found.setdefault("min" if word in LOWER else "max", word)
                break
    if len(found) != 1:
        return None
    [(mode, word)] = found.items()
    return mode, word


def metric_mode(metric: str, mode: Optional[str], what: str, setting: str) -> str:
    """`mode` when given, else the direction `metric`'s name says. `what` names where the metric
    is set (trainer.save_best), `setting` how to give the mode, with {mode} in it
    (trainer.save_best_mode={mode}): a name without a known direction is refused with it."""
    if mode is not None:
        if mode not in MODES:
            raise ConfigError(f"{setting.format(mode=mode)}: the mode must be min or max.")
        return mode
    inferred = infer_mode(metric)
    if inferred is None:
        raise ConfigError(
            f"{what}={metric}: saferun cannot tell from the name whether lower or higher is "
            f"better. Say it: {setting.format(mode='max')} (higher is better) or "
            f"{setting.format(mode='min')} (lower is better).")
    return inferred[0]


def inference_note(metric: str, what: str, setting: str) -> str:
    """The line that says an inferred direction (once, where the setting is used)."""
    inferred = infer_mode(metric)
    assert inferred is not None, metric  # metric_mode refused it
    mode, word = inferred
    other = "min" if mode == "max" else "max"
    return (f"{what}={metric}: {'higher' if mode == 'max' else 'lower'} is better (inferred "
            f"from '{word}' in the name; {setting.format(mode=other)} says otherwise).")
