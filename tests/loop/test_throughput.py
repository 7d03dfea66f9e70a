"""The throughput report (issue 35, item 4): FLOPs per step counted once on the first step,
tokens/s where the task says, MFU where the peak is known, perf/* in every logger."""

import json
import logging

import pytest
import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import TensorDataset

import saferun
from saferun.loop.throughput import peak_for

BATCH, IN, HIDDEN, OUT = 8, 16, 32, 4
# A linear layer's matmul is 2 * batch * in * out FLOPs. Forward: both layers; backward: the
# second layer's weight and input gradients, the first layer's weight gradient only (the data
# needs no gradient).
FIRST, SECOND = 2 * BATCH * IN * HIDDEN, 2 * BATCH * HIDDEN * OUT
FLOPS = (FIRST + SECOND) + (2 * SECOND + FIRST)


class Mlp(saferun.Trainer):
    def build_model(self):
        return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))

    def build_datasets(self):
        g = torch.Generator().manual_seed(0)
        return TensorDataset(torch.randn(64, IN, generator=g), torch.randint(0, OUT, (64,), generator=g)), None

    def training_step(self, batch):
        x, y = batch
        return F.cross_entropy(self.model(x), y)


class Tokens(Mlp):
    def tokens_per_sample(self):
        return 12


def config(tmp_path, **trainer):
    return {"trainer": {"max_steps": 12, "batch_size": BATCH, "log_every_n_steps": 4,
                        "run_dir": str(tmp_path / "run"), "progress_bar": False, **trainer}}


def test_flops_are_counted_once_and_reported_to_every_logger(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="saferun"):
        t = Mlp(config(tmp_path))
        final = t.fit()
    assert final["perf/flops_per_step"] == FLOPS
    assert final["perf/tflops_per_sec"] == pytest.approx(FLOPS * final["perf/steps_per_sec"] / 1e12)
    assert "perf/mfu" not in final and "perf/tokens_per_sec" not in final  # CPU; no tokens
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("perf:")]
    assert len(said) == 1 and "MFU: unknown peak on cpu" in said[0], said
    assert "train_step" not in t.__dict__  # later steps run the method itself, uncounted
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [x for x in lines if "perf/flops_per_step" in x]
    assert [x["step"] for x in logged] == [4, 8, 12]
    assert {x["perf/flops_per_step"] for x in logged} == {FLOPS}
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.value for e in acc.Scalars("perf/flops_per_step")] == [FLOPS] * 3
    assert len(acc.Scalars("perf/tflops_per_sec")) == 3


def test_tokens_per_second_where_the_task_says_how_many_a_sample_holds(tmp_path):
    final = Tokens(config(tmp_path)).fit()
    assert final["perf/tokens_per_sec"] == pytest.approx(12 * final["perf/samples_per_sec"])


def test_the_flops_of_an_accumulated_step_are_those_of_all_its_micro_batches(tmp_path):
    final = Mlp(config(tmp_path, accumulate=2)).fit()
    assert final["perf/flops_per_step"] == 2 * FLOPS


@pytest.mark.parametrize("name, precision, peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4),  # dense: not the data sheet's 1979 (sparse)
    ("NVIDIA H200", "bf16", 989.4),
    ("NVIDIA H100 PCIe", "bf16", 756.0),
    ("NVIDIA H100 NVL", "bf16", None),  # not the SXM's peak: unknown
    ("NVIDIA H200 NVL", "bf16", None),
    ("Tesla V100-SXM2-16GB", "fp16", 125.0),
    ("Tesla V100-PCIE-32GB", "fp16", 112.0),
    ("Tesla V100-SXM2-16GB", "bf16", None),  # no bf16 tensor cores
    ("Tesla T4", "fp16", 65.0),
    ("Tesla T4", "bf16", None),
    ("NVIDIA A100-SXM4-80GB", "fp16", 312.0),
    ("NVIDIA A10", "bf16", 125.0),
    ("NVIDIA A10G", "bf16", None),  # not the A10: no guess
    ("NVIDIA L40S", "bf16", 362.0),
    ("NVIDIA L4", "bf16", 121.0),
    ("NVIDIA A100-SXM4-80GB", "fp32", None),  # the table holds bf16/fp16 peaks
    ("Some Future GPU", "bf16", None),
])
def test_the_peak_is_known_for_common_gpus_only(name, precision, peak):
    assert peak_for(name, precision)[0] == peak
