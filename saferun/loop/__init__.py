"""The training loop's machinery: batch stream, step helpers, the update, evaluation, metrics,
precision, compilation checks, several optimizers. `saferun.trainer.Trainer` reads top to bottom
over these."""

from typing import Any


def __getattr__(name: str) -> Any:  # `saferun.loop.NAME` after `import saferun` alone
    from .. import submodule

    return submodule(__name__, name)
