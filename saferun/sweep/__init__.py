"""Many runs: a sweep's objective and summary (`objective`, `summary`), saferun's Optuna sweeper
(`hydra_plugins.saferun_optuna`), and jobs started by Hydra's submitit launcher, on SLURM or
locally (`cluster`). Nothing here is imported by a single run until it is used."""
