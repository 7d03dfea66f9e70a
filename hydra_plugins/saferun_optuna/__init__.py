"""saferun's Optuna sweeper, a Hydra plugin (`hydra/sweeper=optuna`, conf/hydra/sweeper/optuna.yaml).

Hydra imports every module under `hydra_plugins` at start-up to find plugins, so this package
imports only Hydra; the study itself is `saferun.sweep.study`, imported when a sweep starts."""
