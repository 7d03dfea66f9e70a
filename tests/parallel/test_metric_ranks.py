"""Validation means under real torchrun (gloo): each key's sample count is summed over ranks,
and ranks that saw different keys still reduce the same columns."""

import json
import subprocess
import sys

from helpers import free_port
from test_torchrun import TIMEOUT

SCRIPT = """
import json, os, sys
import torch
import torch.distributed as dist
from saferun.loop.metrics import WeightedMeans

dist.init_process_group("gloo")
rank = dist.get_rank()
means = WeightedMeans()
if rank == 0:   # 'a' on 3 + 1 samples here, 'b' only on this rank
    means.add({"a": torch.tensor(1.0)}, 3)
    means.add({"a": torch.tensor(2.0), "b": torch.tensor(4.0)}, 1)
else:           # 'a' on 2 samples here, 'c' only on this rank
    means.add({"a": torch.tensor(5.0), "c": torch.tensor(7.0)}, 2)
values, extra = means.read({"flag": torch.tensor(float(rank))}, torch.device("cpu"))
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump({"values": values, "extra": extra}, f)
dist.destroy_process_group()
"""


def test_per_key_counts_are_reduced_over_ranks_that_saw_different_keys(tmp_path):
    script = tmp_path / "means.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           f"--master_port={free_port()}", str(script), str(tmp_path)],
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["values"] == {"a": (3 * 1.0 + 2.0 + 2 * 5.0) / 6, "b": 4.0, "c": 7.0}
        assert got["extra"] == {"flag": 1.0}
