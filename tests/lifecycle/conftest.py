import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """The grid's runs, each event once per session (see runs.py)."""
    from runs import Runs

    os.environ.setdefault("WANDB_SILENT", "true")
    return Runs(tmp_path_factory.mktemp("lifecycle"))
