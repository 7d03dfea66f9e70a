"""Test your training code: short, exact checks of a Trainer, for pytest.

Each helper takes a `Job` (a Trainer subclass and its config), runs a few short training
runs in a temporary directory on one torch thread, and fails the test with a message
that says what differs and where::

    from saferun import testing

    job = testing.trainer(MyTrainer, {"trainer": {"batch_size": 64}, "optim": {...}})
    job = testing.recipe("myproject", "trainer.device=cpu", config_dir=PROJECT_DIR)

    testing.assert_checks_pass(job, warn_ok=["one-batch overfit"])  # `saferun check`
    testing.assert_resumes_exactly(job)       # stop mid-epoch, at an epoch's end, in validation
    testing.assert_golden_losses(job, "tests/golden/myproject.json")   # first 5 losses
    testing.assert_no_host_syncs(job)         # no .item() & co. in training_step
    testing.assert_deterministic(job)         # one seed, one result; workers draw differently

`pytest --saferun-update-golden` writes the golden files. The pytest plugin (installed
with saferun, `saferun.pytest_plugin`) adds that option and the fixtures
`saferun_update_golden` and `saferun_testing`, and imports nothing until used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers: the lazy exports below (F401: used through __getattr__)
    from .checks import assert_checks_pass, assert_deterministic, assert_no_host_syncs  # noqa: F401
    from .golden import assert_golden_losses, first_losses  # noqa: F401
    from .jobs import Job, recipe, trainer  # noqa: F401
    from .resume import STOPS, assert_resumes_exactly, state_differences  # noqa: F401

# Imported on first use: `saferun new` writes test files (saferun.cli.project) without
# importing torch.
_EXPORTS = {
    "assert_checks_pass": "checks", "assert_deterministic": "checks",
    "assert_no_host_syncs": "checks", "assert_golden_losses": "golden", "first_losses": "golden",
    "Job": "jobs", "recipe": "jobs", "trainer": "jobs", "STOPS": "resume",
    "assert_resumes_exactly": "resume", "state_differences": "resume",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'saferun.testing' has no attribute {name!r}")
