"""The training loop's machinery: loop state, batch stream, step helpers, metrics, precision,
compilation checks and seeding. `saferun.trainer.Trainer` reads top to bottom over these."""

from typing import Any


def __getattr__(name: str) -> Any:  # `saferun.loop.NAME` after `import saferun` alone
    from .. import submodule

    return submodule(__name__, name)
