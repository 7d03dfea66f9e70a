"""DataLoader workers started by the loop do not act on signals sent to the process group."""

import json
import subprocess
import sys

import pytest

# In a fresh interpreter: the first spawn loader of a process also starts multiprocessing's
# resource tracker, which unblocks SIGINT and SIGTERM in the parent as it does so.
SCRIPT = """
import json, multiprocessing, os, sys
import torch
from torch.utils.data import DataLoader, TensorDataset
from saferun.preemption import shielded_iter

def blocked(pid):  # the signal numbers `pid` blocks, from /proc (Linux)
    with open(f"/proc/{pid}/status") as f:
        mask = int(next(line for line in f if line.startswith("SigBlk:")).split()[1], 16)
    return [n for n in range(1, 64) if mask >> (n - 1) & 1]

if __name__ == "__main__":
    loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2, num_workers=2,
                        multiprocessing_context=sys.argv[1])
    before = set(multiprocessing.active_children())
    batches = shielded_iter(loader)
    workers = [p.pid for p in multiprocessing.active_children() if p not in before and p.daemon]
    print(json.dumps({"workers": [blocked(pid) for pid in workers], "main": blocked(os.getpid()),
                      "samples": sum(len(b[0]) for b in batches)}))
"""


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_start_with_sigterm_and_sigint_blocked_and_the_loop_does_not(context, tmp_path):
    (tmp_path / "shield.py").write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(tmp_path / "shield.py"), context],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.splitlines()[-1])
    assert len(found["workers"]) == 2 and found["samples"] == 8
    for blocked in found["workers"]:
        assert {15, 2} <= set(blocked)  # SIGTERM, SIGINT
    assert not {15, 2} & set(found["main"])
