"""A new user's first hour on the command line (issue 36): documented options that work as
written, and for each mistake one `saferun: error:` line that names the key, the cause and the
fix, with no traceback and nothing left on disk."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra.utils import get_class

ROOT = Path(__file__).resolve().parents[2]
FAST = ["debug=fast", "trainer.progress_bar=false"]


def saferun(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "saferun", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("option", ["mlflow", "wandb"])
def test_every_option_of_a_tracker_is_a_key_of_its_config_node(option):
    """`logger.wandb.mode=online` (docs/logging.md) and `logger.mlflow.tracking_uri=...` (the
    option's own comment) need no `+`: the node lists each argument of its logger."""
    from saferun.cli import compose_config

    node = yaml.safe_load((ROOT / "conf" / "logger" / f"{option}.yaml").read_text())[option]
    arguments = set(inspect.signature(get_class(node["_target_"])).parameters)
    assert set(node) - {"_target_"} == arguments
    value = {"mlflow": "http://127.0.0.1:5000", "wandb": "online"}
    key = {"mlflow": "tracking_uri", "wandb": "mode"}[option]
    config = compose_config([f"logger={option}", f"logger.{option}.{key}={value[option]}"])
    assert config.logger[option][key] == value[option]
