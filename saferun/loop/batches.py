"""The epoch / micro-batch stream of the training loop."""

from __future__ import annotations

from typing import Any, Iterator


def take(iterator: Iterator[Any], n: int) -> list[Any]:
    group = []
    for batch in iterator:
        group.append(batch)
        if len(group) == n:
            break
    return group
