"""The pytest options of saferun's plugin, as the helpers read them (no import of pytest or torch)."""

from __future__ import annotations

update_golden: list[bool] = []  # one entry per configured pytest session (pytester nests them)


def update_golden_requested() -> bool:
    """True when the running pytest session was given `--saferun-update-golden`."""
    return bool(update_golden and update_golden[-1])
