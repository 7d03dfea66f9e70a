"""`python -m torch.distributed.run --nproc_per_node=2 eval_job.py CONFIG_JSON OUT_JSON` (or the
same without torchrun): Trainer.test() over 61 samples (shards of 31 and 30), with a test_step
that returns means and self.log()s a max; rank 0 writes the metrics to OUT_JSON,
each rank the number of test samples it saw to OUT_JSON.rank<R>."""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import torch.nn.functional as F

from toys import ToyTrainer, make_classification


class Tested(ToyTrainer):
    def test_step(self, batch: Any) -> dict[str, torch.Tensor]:
        x, y = batch
        self.samples += len(y)
        logits = self.model(x)
        self.log("worst", F.cross_entropy(logits, y, reduction="none").max(), reduce="max")
        return super().test_step(batch)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    trainer = Tested(cfg)
    trainer.samples = 0
    x, y = make_classification(61, seed=3)
    metrics = trainer.test(torch.utils.data.TensorDataset(x, y))
    with open(f"{sys.argv[2]}.rank{trainer.ranks.rank}", "w") as f:
        f.write(str(trainer.samples))  # this rank's share of the test set
    if trainer.ranks.is_main:
        with open(sys.argv[2], "w") as f:
            json.dump(metrics, f)


if __name__ == "__main__":
    main()
    from saferun.distributed import end_process

    end_process()  # before interpreter teardown, where gloo can abort a rank
