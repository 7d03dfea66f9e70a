"""saferun's pytest plugin, loaded by pytest through the `pytest11` entry point.

It adds one option and two fixtures and imports nothing else: torch and the
Trainer are imported only when a test uses a fixture or `saferun.testing`, so the
test runs of projects that do not use saferun are unchanged (tested).

- `--saferun-update-golden`: `saferun.testing.assert_golden_losses` writes the
  golden file instead of comparing with it.
- fixture `saferun_update_golden`: whether that option is given.
- fixture `saferun_testing`: the `saferun.testing` module (imported on use).
"""

from __future__ import annotations

from typing import Any

from .testing import options  # the package's __init__ imports nothing until an attribute is used


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("saferun", "saferun: tests of training code (saferun.testing)")
    group.addoption("--saferun-update-golden", action="store_true", default=False,
                    help="write or refresh the golden-loss files of saferun.testing."
                         "assert_golden_losses instead of comparing with them")


def pytest_configure(config: Any) -> None:
    options.update_golden.append(bool(config.getoption("saferun_update_golden", False)))


def pytest_unconfigure(config: Any) -> None:
    if options.update_golden:
        options.update_golden.pop()


def _fixture(func: Any) -> Any:
    import pytest  # only under pytest, which is what loads this module

    return pytest.fixture(func)


@_fixture
def saferun_update_golden(request: Any) -> bool:
    """Whether `--saferun-update-golden` was given."""
    return bool(request.config.getoption("saferun_update_golden"))


@_fixture
def saferun_testing() -> Any:
    """`saferun.testing`, imported when a test asks for it."""
    import saferun.testing

    return saferun.testing
