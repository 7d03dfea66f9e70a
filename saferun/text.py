"""Pieces of the messages saferun writes: a long list shortened, an exception's root cause."""

from __future__ import annotations

from typing import Any, Sequence


def short(items: Sequence[Any], limit: int = 16) -> str:
    shown = ", ".join(map(str, items[:limit]))
    return f"[{shown}{', ...' if len(items) > limit else ''}] ({len(items)} in all)"


def root_cause(e: BaseException) -> str:
    while e.__cause__ is not None:
        e = e.__cause__
    return f"{type(e).__name__}: {e}"
