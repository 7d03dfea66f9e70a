"""The charlm recipe's trainer for the device-mesh tests, run by the real CLI
(`task._target_=mesh_job.CountingCharLM`, with tests/parallel on PYTHONPATH):

- it logs `seen`, the samples of each step and validation batch, summed (reduce="sum"): over
  the data dimension only it equals one process's count; over every rank it would be tp times;
- `signal_at`/`on_rank`: SIGTERM to itself at that step, on that global rank only;
- after fit, each rank writes `rank<R>.json`: whether its qkv weights are DTensors and the
  shape of its local part (so the test sees the model really split).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any, Mapping

import torch

from saferun.recipes.charlm import CharLMTrainer


class CountingCharLM(CharLMTrainer):
    def __init__(self, cfg: Any = None, callbacks: Any = (), signal_at: int = -1,
                 on_rank: int = -1, **kw: Any) -> None:
        super().__init__(cfg, callbacks, **kw)
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
