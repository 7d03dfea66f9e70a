"""Guard 2: replaying a bad batch under anomaly mode names the op, the line, or the parameter."""

import warnings

import pytest
import torch
from torch import nn

from saferun.guards.replay import first_nonfinite, replay
from saferun.guards.syncs import HostSyncCounter


class MaskedSqrt(nn.Module):
    """Planted bug: where(x > 0, sqrt(x), 0) has a NaN gradient at x == 0 (the masked branch)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 0, torch.sqrt(x), torch.zeros_like(x))


class LogOfNegative(nn.Module):
    """Planted bug: log of a possibly negative input; NaN in forward, finite gradients."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


class SqrtScale(nn.Module):
    """Planted bug: sqrt of a parameter that is 0, whose gradient is Inf, never NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sqrt(self.scale)


def model_with(layer: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), layer, nn.Linear(4, 1))


def step_fn(model: nn.Module, x: torch.Tensor):
    def run() -> torch.Tensor:
        loss = model(x).mean()
        loss.backward()
        return loss
    return run


def test_nan_from_backward_names_the_op_and_the_forward_line():
    model = model_with(MaskedSqrt())
    x = torch.zeros(2, 3)  # Linear(0) = bias; make some pre-activations exactly 0
    with torch.no_grad():
        model[0].bias.copy_(torch.tensor([0.0, 1.0, 0.0, 2.0]))
    report = replay(step_fn(model, x), model)
    assert report.backward_op == "SqrtBackward0"
    assert report.forward_trace is not None
    assert report.forward_trace.splitlines()[-1].strip() == (
        "return torch.where(x > 0, torch.sqrt(x), torch.zeros_like(x))")
    assert "torch/nn/modules" not in report.forward_trace  # only the user's frames
    text = str(report)
    assert "backward: SqrtBackward0 returned NaN; the forward call that created it:" in text
    assert report.forward_trace.splitlines()[0].strip().endswith(", in run")  # from run() on
    without_model = replay(step_fn(model, x))
    assert without_model.backward_op == "SqrtBackward0" and without_model.first_bad_grad is None


def test_nan_made_in_forward_is_localised_to_the_module():
    model = model_with(LogOfNegative())
    with torch.no_grad():
        model[0].bias.copy_(torch.tensor([-1.0, 1.0, 1.0, 1.0]))
        model[0].weight.zero_()
    report = replay(step_fn(model, torch.ones(2, 3)), model)
    assert report.first_bad_output == "1 (LogOfNegative): 2 NaN and 0 Inf of 8 values"
    # Anomaly mode blames the first backward op that outputs NaN: the consumer's.
    assert report.backward_op == "AddmmBackward0"
    assert report.forward_trace.splitlines()[-1].strip() == "loss = model(x).mean()"


def test_inf_is_not_localised_by_anomaly_mode_and_the_parameter_is_named_instead():
    model = nn.Sequential(nn.Linear(3, 4), SqrtScale())
    report = replay(step_fn(model, torch.ones(2, 3)), model)
    assert report.backward_op is None  # detect_anomaly checks NaN only (pitfall C50)
    assert report.first_bad_grad == "1.scale: 0 NaN and 1 Inf of 1 values"
    assert report.loss == 0.0
    assert "checks NaN only, not Inf" in str(report)


def test_replay_clears_old_gradients_removes_its_hooks_and_leaves_anomaly_mode_off():
    model = model_with(nn.ReLU())
    model[0].weight.grad = torch.full_like(model[0].weight, float("nan"))  # a stale bad grad
    report = replay(step_fn(model, torch.ones(2, 3)), model)
    assert report.backward_op is None and report.first_bad_grad is None
    assert report.first_bad_output is None
    assert all(not m._forward_hooks for m in model.modules())
    assert not torch.is_anomaly_enabled()


def test_the_runs_own_warnings_are_passed_on_and_anomaly_modes_are_not(recwarn):
    model = model_with(MaskedSqrt())

    def run() -> None:
        warnings.warn("from the user's step", UserWarning, stacklevel=1)
        step_fn(model, torch.zeros(2, 3))()

    with torch.no_grad():
        model[0].bias.zero_()
    assert replay(run, model).backward_op == "SqrtBackward0"
    assert [str(w.message) for w in recwarn] == ["from the user's step"]


def test_other_errors_propagate_and_hooks_are_still_removed():
    model = model_with(nn.ReLU())

    def run() -> None:
        model(torch.ones(2, 3))
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        replay(run, model)
    assert all(not m._forward_hooks for m in model.modules())


def test_first_nonfinite_names_the_first_bad_tensor_in_one_read():
    inf, nan = float("inf"), float("nan")
    tensors = [("a", torch.ones(3)), ("b", None), ("c", torch.tensor([1.0, inf, nan])),
               ("d", torch.tensor([float("nan")]))]
    with HostSyncCounter() as counter:
        assert first_nonfinite(tensors[:2]) is None
        assert counter.count == 1
        assert first_nonfinite(tensors) == "c: 1 NaN and 1 Inf of 3 values"
    assert counter.count == 3
    assert first_nonfinite([]) is None
