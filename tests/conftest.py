import os
import sys

import pytest
import torch

# Toy trainers live in tests/toys.py; DataLoader workers started with spawn import
# them by module name, so the tests directory must be importable in every process.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("PYTHONPATH", os.path.dirname(__file__))

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
