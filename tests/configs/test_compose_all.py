"""Every shipped YAML composes and its _target_s instantiate (R8)."""

import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

import saferun.conf
from saferun.cli import _register_with_hydra
from saferun.config import load_config

CONF = Path(saferun.conf.__file__).parent
# Tiny, CPU-safe settings: the point is that everything builds, not that it trains.
TINY = ["trainer.device=cpu", "trainer.max_steps=2", "trainer.progress_bar=false",
        "logger=none", "trainer.num_workers=0"]


def shipped_configs() -> list[str]:
    return sorted(p.relative_to(CONF).as_posix() for p in CONF.rglob("*.yaml"))


def overrides_for(path: str) -> list[str]:
    """The command-line choice that selects this config file."""
    if path == "config.yaml":
        return []
    group, option = path[: -len(".yaml")].split("/")
    if (CONF / "recipe" / f"{option}.yaml").is_file() and group != "recipe":
        # a recipe's own model or data option may refer to its other nodes (${model.context})
        return [f"recipe={option}", f"{group}={option}"]
    return [f"{group}={option}"]


@pytest.mark.parametrize("path", shipped_configs())
def test_config_composes_and_instantiates(path, tmp_path):
    _register_with_hydra()
    with initialize_config_module(config_module="saferun.conf", version_base="1.3"):
        cfg = compose("config", overrides=overrides_for(path) + TINY
                      + [f"trainer.run_dir={tmp_path}"], return_hydra_config=False)
    config = load_config(OmegaConf.to_container(cfg, resolve=True))
    from hydra.utils import get_class

    task = dict(config.task)
    trainer = get_class(task.pop("_target_"))(config, **task)
    trainer.setup()  # builds model, datasets, loaders, optimizer, scheduler and callbacks
    assert trainer.model is not None and trainer.optimizer is not None
    assert next(iter(trainer.train_loader)) is not None


def test_every_yaml_on_disk_is_tested():
    on_disk = [os.path.join(root, f) for root, _, files in os.walk(CONF) for f in files
               if f.endswith((".yaml", ".yml"))]
    assert len(on_disk) == len(shipped_configs())
    assert not [f for f in on_disk if f.endswith(".yml")], "use .yaml: Hydra only finds .yaml"
    # Update when adding a config: the parametrised test above must cover it.
    assert len(shipped_configs()) == 24
