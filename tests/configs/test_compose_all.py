"""Every shipped YAML composes and its _target_s instantiate (R8)."""

import os
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.utils import get_class, get_object
from omegaconf import OmegaConf
from torch.optim.lr_scheduler import LRScheduler

import saferun.conf
from saferun.cli import _register_with_hydra
from saferun.config import load_config
from saferun.guards.sync_audit import SyncAudit

CONF = Path(saferun.conf.__file__).parent
# Tiny, CPU-safe settings: the point is that everything builds, not that it trains.
TINY = ["trainer.device=cpu", "trainer.max_steps=2", "trainer.progress_bar=false",
        "logger=none", "trainer.num_workers=0"]


def shipped_configs() -> list[str]:
    """The job's configs; conf/hydra/ holds Hydra's own (the Optuna sweeper: tests/sweeps)."""
    return sorted(p.relative_to(CONF).as_posix() for p in CONF.rglob("*.yaml")
                  if p.relative_to(CONF).parts[0] != "hydra")


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
    task = dict(config.task)
    trainer = get_class(task.pop("_target_"))(config, **task)
    trainer.setup()  # builds model, datasets, loaders, optimizer, scheduler and callbacks
    assert_built_as_configured(trainer, config)
    batch = next(iter(trainer.train_loader))
    assert trainer.batch_size(batch) == config.trainer.batch_size
    out = trainer.train_step([batch])  # and it trains: one real optimizer step
    assert trainer.state.step == 1 and torch.isfinite(out.loss)


def assert_built_as_configured(trainer, config):
    """Each component is the class its node names, with the node's arguments."""
    # several named optimizers (the gan recipe): each is built from the optim node
    several = isinstance(trainer.optimizer, Mapping)
    for optimizer in trainer.optimizer.values() if several else [trainer.optimizer]:
        optim = dict(config.optim)
        assert type(optimizer) is get_class(optim.pop("_target_"))
        group = dict(optimizer.param_groups[0])
        group["lr"] = group.get("initial_lr", group["lr"])  # a schedule may have started its warm-up
        for key, value in optim.items():
            assert group[key] == (tuple(value) if isinstance(value, list) else value), key
    if config.sched is None:
        assert trainer.scheduler is None
    else:
        target = get_object(config.sched["_target_"])
        for scheduler in trainer.scheduler.values() if several else [trainer.scheduler]:
            assert isinstance(scheduler, target if isinstance(target, type) else LRScheduler)
    if config.model is not None:
        assert isinstance(trainer.model, get_class(config.model["_target_"]))
    built = [type(c) for c in trainer.callbacks]
    for key in ("callbacks", "logger"):
        for node in (getattr(config, key) or {}).values():
            if node is not None:
                assert get_class(node["_target_"]) in built, node["_target_"]
    spikes = trainer.state_dict()["per_rank"][0]["spikes"]  # the spike detectors' state
    assert bool(spikes) == (config.guards.spikes != "off")
    assert (SyncAudit in built) == config.guards.sync_audit


def test_every_yaml_on_disk_is_tested():
    on_disk = [os.path.join(root, f) for root, _, files in os.walk(CONF) for f in files
               if f.endswith((".yaml", ".yml"))]
    assert len(on_disk) == len(shipped_configs()) + len(list((CONF / "hydra").rglob("*.yaml")))
    assert not [f for f in on_disk if f.endswith(".yml")], "use .yaml: Hydra only finds .yaml"
    # Update when adding a config: the parametrised test above must cover it.
    assert len(shipped_configs()) == 31
