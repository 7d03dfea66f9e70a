"""`python tests/recipes/gan_job.py RUN_DIR PLANT_JSON [OVERRIDES...]`, alone or under torchrun:
train the GAN recipe (composed as `saferun run recipe=gan OVERRIDES` would, on the CPU) and
write <RUN_DIR>/final_rank<R>.pt: the model, both optimizers' and schedulers' states and the
final metrics. PLANT_JSON: {"kill_at": N} sends SIGKILL to this process after step N."""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

import torch
from hydra.utils import get_class

import saferun
from saferun.cli import compose_config


class KillAt(saferun.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_step_end(self, view: Any, output: Any) -> None:
        if view.step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    run_dir, plant, *overrides = sys.argv[1:]
    kill_at = json.loads(plant).get("kill_at")
    config = compose_config(["recipe=gan", "trainer.device=cpu", "logger=none", "task.sample_digits=0",
                             "trainer.progress_bar=false", f"trainer.run_dir={run_dir}", *overrides])
    task = dict(config.task)
    trainer = get_class(task.pop("_target_"))(
        config, callbacks=[KillAt(kill_at)] if kill_at is not None else [], **task)
    metrics = trainer.fit()
    torch.save({"model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict(),
                "scheduler": trainer.scheduler.state_dict() if trainer.scheduler else None,
                "metrics": {k: v for k, v in metrics.items() if not k.startswith("perf/")}},
               os.path.join(run_dir, f"final_rank{trainer.ranks.rank}.pt"))


if __name__ == "__main__":
    main()
    from saferun.distributed import end_process

    end_process()  # before interpreter teardown, where gloo can abort a rank
