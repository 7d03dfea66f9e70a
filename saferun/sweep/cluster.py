"""Jobs started by Hydra's submitit launcher (`hydra/launcher=submitit_slurm` or
`submitit_local`): each of a job's processes joins one torch.distributed job, as under torchrun,
and a job stopped by the scheduler's preemption signal saves at the next step boundary and is
requeued, to resume exactly in the same run directory."""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import sys
import zlib
from typing import Any, Callable, Optional

# The optional extras, by the command-line choice that needs them: (module, extra).
EXTRAS = {"hydra/sweeper=optuna": ("optuna", "sweep"),
          "hydra/launcher=submitit_": ("hydra_plugins.hydra_submitit_launcher", "slurm")}


def prepare_multirun(args: list[str]) -> None:
    """Before a sweep: a sweeper or launcher chosen without its package is refused with the
    extra that installs it; saferun's Optuna sweeper is registered with Hydra (whose scan of
    `hydra_plugins` misses it in an editable install)."""
    for arg in args:
        for choice, (module, extra) in EXTRAS.items():
            if arg.startswith(choice) and importlib.util.find_spec(module) is None:
                print(f"saferun: error: {arg} needs the {module.split('.')[-1]} package, which is "
                      f"not installed: pip install 'saferun[{extra}]'", file=sys.stderr)
                raise SystemExit(1)
    from hydra.core.plugins import Plugins
    from hydra_plugins.saferun_optuna.sweeper import OptunaSweeper

    Plugins.instance().register(OptunaSweeper)


def torch_env(job: Any) -> dict[str, str]:
    """The variables of torch.distributed's env:// rendezvous (what torchrun sets) for one
    process of a submitit job, from its `submitit.JobEnvironment`, which reads SLURM's
    SLURM_PROCID (RANK), SLURM_LOCALID (LOCAL_RANK), SLURM_NTASKS (WORLD_SIZE),
    SLURM_JOB_NUM_NODES and SLURM_JOB_NODELIST (its first host: MASTER_ADDR). MASTER_PORT is
    $MASTER_PORT if set, else derived from the job id, so a requeued job picks the same one."""
    port = os.environ.get("MASTER_PORT") or str(20000 + zlib.crc32(job.job_id.encode()) % 20000)
    return {"RANK": str(job.global_rank), "LOCAL_RANK": str(job.local_rank),
            "WORLD_SIZE": str(job.num_tasks),
            "LOCAL_WORLD_SIZE": str(job.num_tasks // job.num_nodes),
            "MASTER_ADDR": "127.0.0.1" if job.name() == "local" else job.hostnames[0],
            "MASTER_PORT": port}


def in_job(train: Callable[[Any], Optional[float]], cfg: Any) -> Optional[float]:
    """Run `train(cfg)`; in a submitit job: as one rank of the job's processes, listening to
    the preemption signal, resuming its run directory (resume=auto) when requeued, and
    requeued (submitit's checkpoint-and-requeue) when that signal stopped it."""
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return train(cfg)
    import submitit
    from omegaconf import open_dict

    from ..preemption import Preempted

    job = submitit.JobEnvironment()
    preempt = getattr(signal, "SIG" + job.USR_SIG)  # $SUBMITIT_PREEMPT_SIGNAL, else USR2
    with open_dict(cfg):
        if preempt.name not in cfg.trainer.stop_signals:
            cfg.trainer.stop_signals = [*cfg.trainer.stop_signals, preempt.name]
        if cfg.resume is None:  # a new directory the first time; its checkpoint once requeued
            cfg.resume = "auto"
    joined = job.num_tasks > 1
    if joined:
        _join(job)
    try:
        return train(cfg)
    except Preempted as stop:
        handler = signal.getsignal(stop.signum)
        if stop.signum == preempt and callable(handler):
            handler(stop.signum, None)  # submitit's: rank 0 checkpoints the job, requeues, exits
        raise
    finally:
        if joined:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def _join(job: Any) -> None:
    """Join the job's process group as torchrun's workers do; ranks other than 0 keep no log file
    (Hydra opened one per process)."""
    import torch

    from ..config import TrainerConfig
    from ..distributed import ranks_from_env, start

    os.environ.update(torch_env(job))
    # Bounded from the start; the Trainer then applies the config's trainer.collective_timeout.
    start(ranks_from_env(), torch.device("cuda" if torch.cuda.is_available() else "cpu"),
          TrainerConfig.collective_timeout)
    if job.global_rank != 0:
        root = logging.getLogger()
        for handler in [h for h in root.handlers if isinstance(h, logging.FileHandler)]:
            root.removeHandler(handler)
            handler.close()
