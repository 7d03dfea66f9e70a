"""Exceptions saferun raises for problems the user can fix, in one module (feature modules raise them)."""

from __future__ import annotations


class SaferunError(Exception):
    """A problem in the user's code, data or config, with a message saying what to do."""


class ConfigError(SaferunError, ValueError):
    """A config value has the wrong type, an unknown key or an out-of-range value."""


class NonFiniteError(SaferunError):
    """NaN or Inf in the loss, the gradients or the parameters."""


class CheckpointError(SaferunError):
    """A checkpoint is missing, incomplete, corrupted or unsafe to load."""


class UserCodeError(SaferunError):
    """An exception raised in the user's code, re-raised with an explanation. The original
    is its `__cause__` (and `original`), and the explained error is also an instance of the
    original's type, so `except RuntimeError` (KeyError, ...) still catches it. Only the
    common builtin types are explained; any other exception propagates unchanged."""

    original: BaseException

    def __str__(self) -> str:  # KeyError's own __str__ would show the message's repr
        return str(self.args[0]) if self.args else ""


class ExplainedRuntimeError(UserCodeError, RuntimeError):
    pass


class ExplainedValueError(UserCodeError, ValueError):
    pass


class ExplainedTypeError(UserCodeError, TypeError):
    pass


class ExplainedIndexError(UserCodeError, IndexError):
    pass


class ExplainedKeyError(UserCodeError, KeyError):
    pass


class ExplainedAttributeError(UserCodeError, AttributeError):
    pass


class ExplainedAssertionError(UserCodeError, AssertionError):
    pass


class CompileMismatchError(SaferunError):
    """The compiled model's output differs from eager beyond the configured tolerance."""


class LossCallError(SaferunError, ValueError):
    """A loss function was called with arguments that would train silently wrong."""


class ModelStateError(SaferunError):
    """The model holds state where training or checkpoints cannot see it."""
