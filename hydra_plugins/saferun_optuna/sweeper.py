"""The Hydra Sweeper class; the study it runs is `saferun.sweep.study.run_study`."""

from __future__ import annotations

from typing import Any, List, Optional

from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


class OptunaSweeper(Sweeper):
    """`hydra/sweeper=optuna`: trials of an Optuna study, each one job of the launcher."""

    def __init__(self, n_trials: int, n_jobs: int, study_name: str, storage: Optional[str],
                 sampler: Any, params: Optional[dict[str, str]] = None) -> None:
        self.settings = {"n_trials": n_trials, "n_jobs": n_jobs, "study_name": study_name,
                         "storage": storage, "sampler": sampler, "params": dict(params or {})}
        self.config: Optional[DictConfig] = None
        self.launcher: Any = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction,
              config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: List[str]) -> Any:
        from saferun.sweep.study import run_study

        assert self.config is not None
        return run_study(self.settings, self.config, self.launcher, arguments)
