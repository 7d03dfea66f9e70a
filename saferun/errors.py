"""Exceptions saferun raises for problems the user can fix."""

from __future__ import annotations


class SaferunError(Exception):
    """A problem in the user's code, data or config, with a message saying what to do."""


class ConfigError(SaferunError, ValueError):
    """A config value has the wrong type, an unknown key or an out-of-range value."""


class NonFiniteError(SaferunError):
    """NaN or Inf in the loss, the gradients or the parameters."""
