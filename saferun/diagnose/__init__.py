"""Diagnose: a failure explained after the fact, in the user's terms (which step, phase, batch
and module; a replay of the failed forward; under torchrun, which rank failed first)."""

from typing import Any


def __getattr__(name: str) -> Any:  # `saferun.diagnose.NAME` after `import saferun` alone
    from .. import submodule

    return submodule(__name__, name)
