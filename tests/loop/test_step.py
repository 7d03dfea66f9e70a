"""Guarantees 2, 4 and 7: zeroing, clipping, measuring, accumulation and precision."""

import math
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import saferun
from saferun.loop.update import clip_or_measure as _clip_or_measure
from toys import ScaledOnCpu, ToyTrainer, make_classification, toy_config, weights


class Plain(ToyTrainer):
    n_train = 64

    def build_datasets(self):
        x, y = make_classification(64)
        return TensorDataset(x, y), None

    def build_model(self):
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))  # no BN: batch-size free


def test_grads_are_set_to_none_after_each_step(tmp_path):
    t = ToyTrainer(toy_config(tmp_path))
    t.setup()
    t.train_step([next(iter(t.train_loader))])
    assert all(p.grad is None for p in t.model.parameters())


def test_clipping_uses_the_configured_norm_and_reports_the_pre_clip_norm(tmp_path):
    t = Plain(toy_config(tmp_path, max_grad_norm=0.01))
    t.setup()
    batch = next(iter(t.train_loader))
    reference = Plain(toy_config(tmp_path, max_grad_norm=0.01))
    reference.setup()
    # same init (same seed): compute the unclipped gradient by hand
    x, y = batch
    F.cross_entropy(reference.model(x), y).backward()
    grads = [p.grad for p in reference.model.parameters()]
    expected_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    before = weights(t)
    out = t.train_step([batch])
    assert torch.allclose(out.grad_norm, expected_norm)
    assert expected_norm > 0.01
    # SGD without momentum: the update is -lr * clipped grad, whose norm is lr * 0.01
    delta = torch.cat([(before[k] - v).flatten() for k, v in weights(t).items()])
    assert math.isclose(delta.norm().item(), 0.05 * 0.01, rel_tol=1e-3)


def test_measuring_without_clipping_never_touches_gradients():
    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    a.grad = torch.tensor([1.0, float("inf"), 2.0])
    b.grad = torch.tensor([3.0, 4.0])
    norm = _clip_or_measure([a, b], None)
    assert math.isinf(norm.item())
    assert torch.equal(b.grad, torch.tensor([3.0, 4.0]))  # clip_grad_norm_(inf) would make these NaN
    assert a.grad[0] == 1.0 and a.grad[2] == 2.0


def test_measured_norm_is_logged_when_clipping_is_off(tmp_path):
    t = ToyTrainer(toy_config(tmp_path, max_grad_norm=None, max_steps=10))
    metrics = t.fit()
    assert metrics["train/grad_norm"] > 0


@pytest.mark.parametrize("micro, accumulate", [(16, 4), (24, 3)])
def test_accumulated_micro_batches_equal_one_large_batch(tmp_path, micro, accumulate):
    # 24 x 3 over 64 samples gives micro-batches of 24, 24 and 16: weights follow the sizes
    big = Plain(toy_config(tmp_path, batch_size=64, max_steps=1, shuffle=False))
    small = Plain(toy_config(tmp_path / "small", batch_size=micro, accumulate=accumulate,
                             max_steps=1, shuffle=False))
    big.fit()
    small.fit()
    wb, ws = weights(big), weights(small)
    assert small.state.step == 1 and small.state.samples_seen == 64
    for k in wb:
        torch.testing.assert_close(ws[k], wb[k], rtol=0, atol=1e-6)


def test_bf16_autocast_on_cpu(tmp_path):
    class Dtypes(ToyTrainer):
        def training_step(self, batch):
            x, y = batch
            logits = self.model(x)
            self.seen.add(logits.dtype)
            return F.cross_entropy(logits, y)

    t = Dtypes(toy_config(tmp_path, precision="bf16", max_steps=3))
    t.seen = set()
    t.fit()
    assert t.seen == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in t.model.parameters())  # master weights stay fp32


def test_fp16_on_cpu_is_refused_with_the_alternative(tmp_path):
    with pytest.raises(saferun.ConfigError, match="bf16 on CPU"):
        ToyTrainer(toy_config(tmp_path, precision="fp16", device="cpu")).setup()


def test_scheduler_steps_once_per_optimizer_step(tmp_path):
    cfg = toy_config(tmp_path, max_steps=8, accumulate=2)
    cfg["sched"] = {"_target_": "torch.optim.lr_scheduler.StepLR", "step_size": 1, "gamma": 0.5}
    t = ToyTrainer(cfg)
    t.fit()
    assert math.isclose(t.optimizer.param_groups[0]["lr"], 0.05 * 0.5**8)


class ScaledPlain(ScaledOnCpu, Plain):
    pass


@pytest.mark.parametrize("max_norm", [0.01, None])
def test_gradients_are_unscaled_before_they_are_clipped_or_measured(tmp_path, max_norm):
    t = ScaledPlain(toy_config(tmp_path, max_grad_norm=max_norm))
    t.setup()
    batch = next(iter(t.train_loader))
    reference = Plain(toy_config(tmp_path))  # same seed, same initial weights
    reference.setup()
    F.cross_entropy(reference.model(batch[0]), batch[1]).backward()
    true_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.model.parameters()])
    before = weights(t)
    out = t.train_step([batch])
    assert t.scaler.get_scale() == 2.0**10  # the loss really was scaled by 1024
    torch.testing.assert_close(out.grad_norm, true_norm)  # the unscaled norm, not 1024x
    delta = torch.cat([(before[k] - v).flatten() for k, v in weights(t).items()])
    expected = 0.05 * (0.01 if max_norm else true_norm.item())  # SGD: lr * (clipped) gradient
    assert math.isclose(delta.norm().item(), expected, rel_tol=1e-3)


def _functions_called(step, *args):
    """(file, function) of every Python function that runs during step(*args)."""
    called = set()

    def profile(frame, event, arg):
        if event == "call":
            called.add((frame.f_code.co_filename, frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        step(*args)
    finally:
        sys.setprofile(None)
    return called


def test_one_micro_batch_goes_straight_through_and_several_through_accumulate(tmp_path):
    # The hot path (docs/benchmarks.md): one micro-batch (trainer.accumulate=1) needs no list of
    # sizes, weights or sums; several are weighted and summed by loop/steps.accumulate.
    t = Plain(toy_config(tmp_path))
    t.setup()
    x, y = next(iter(t.train_loader))
    names = {name for _, name in _functions_called(t.train_step, [(x, y)])}
    assert "_forward_backward" in names and "accumulate" not in names
    names = {name for _, name in _functions_called(t.train_step, [(x[:5], y[:5]), (x[5:], y[5:])])}
    assert "accumulate" in names
    assert t.state.step == 2 and t.state.samples_seen == 2 * len(x)


def test_max_epochs_stops_after_that_many_passes(tmp_path):
    from saferun import Callback

    class Validations(Callback):
        def __init__(self):
            self.steps = []

        def on_validation_end(self, view, metrics):
            self.steps.append((view.step, view.epoch))

    seen = Validations()
    t = ToyTrainer(toy_config(tmp_path, max_steps=1000, max_epochs=2), callbacks=[seen])
    t.fit()  # 256 samples in batches of 32: 8 steps an epoch
    assert t.state.step == 16 and t.state.samples_seen == 2 * 256
    assert seen.steps == [(8, 0), (16, 1)]  # at each epoch's end; none added after the last
