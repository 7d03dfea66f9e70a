"""The charlm recipe's trainer for the device-mesh tests, run by the real CLI
(`task._target_=mesh_job.CountingCharLM`, with tests/parallel on PYTHONPATH):

- it logs `seen`, the samples of each step and validation batch, summed (reduce="sum"): over
  the data dimension only it equals one process's count; over every rank it would be tp times;
- `signal_at`/`on_rank`: SIGTERM to itself at that step, on that global rank only;
- after fit, each rank writes `rank<R>.json`: whether its qkv weights are DTensors and the
  shape of its local part (so the test sees the model really split);
- `dump`: rank 0 writes the whole model and optimizer state and trainer.ema's average
  (gathered from every rank, keyed by parameter name, so that any layout compares with any) to
  `start.pt` when a resumed run starts (as restored) and `end.pt` when training ends;
- `trajectory`: rank 0 writes the whole weights after each step (ema_trajectory.py).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any, Mapping

import torch

import saferun
from saferun.distributed import is_dtensor
from saferun.recipes.charlm import CharLMTrainer

from ema_trajectory import Trajectory


class Dump(saferun.Callback):
    def __init__(self, trainer: "CountingCharLM") -> None:
        self.trainer = trainer

    def on_fit_start(self, view: Any) -> None:
        if self.trainer.state.step > 0:  # resumed (an empty optimizer's state, read, would be
            self.write("start.pt")       # initialised by torch with a step: not at the start)

    def on_fit_end(self, view: Any, metrics: Any) -> None:
        self.write("end.pt")

    def write(self, name: str) -> None:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_model_state_dict,
                                                             get_optimizer_state_dict)
        tr, options = self.trainer, StateDictOptions(full_state_dict=True, cpu_offload=True)
        model = get_model_state_dict(tr.model, options=options)  # every rank: collectives
        optim = get_optimizer_state_dict(tr.model, tr.optimizer, options=options)
        ema = {k: (v.full_tensor() if is_dtensor(v) else v).clone()  # type: ignore[attr-defined]
               for k, v in (tr.state_dict()["ema"] or {}).items()}
        if tr.ranks.is_main:
            torch.save({"model": model, "optimizer": optim, "ema": ema},
                       Path(tr.state.run_dir, name))


class CountingCharLM(CharLMTrainer):
    def __init__(self, cfg: Any = None, callbacks: Any = (), signal_at: int = -1,
                 on_rank: int = -1, dump: bool = False, trajectory: bool = False,
                 **kw: Any) -> None:
        super().__init__(cfg, [*callbacks, *([Dump(self)] if dump else []),
                               *([Trajectory(self)] if trajectory else [])], **kw)
        self.signal_at, self.on_rank = signal_at, on_rank

    def training_step(self, batch: Any) -> torch.Tensor:
        if self.state.step + 1 == self.signal_at and self.ranks.rank == self.on_rank:
            os.kill(os.getpid(), signal.SIGTERM)
        self.log("seen", float(len(batch[0])), reduce="sum")
        return super().training_step(batch)

    def validation_step(self, batch: Any) -> Mapping[str, torch.Tensor]:
        self.log("seen", float(len(batch[0])), reduce="sum")
        return super().validation_step(batch)

    def after_fit(self, metrics: dict[str, float]) -> None:
        super().after_fit(metrics)
        qkv = self.model.blocks[0].qkv.weight
        local = qkv.to_local() if hasattr(qkv, "to_local") else qkv
        Path(self.state.run_dir, f"rank{self.ranks.rank}.json").write_text(json.dumps(
            {"dtensor": hasattr(qkv, "to_local"), "local_shape": list(local.shape)}))
