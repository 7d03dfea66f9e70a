"""Guard 4: evaluation must not change the model; what it changed is named."""

import pytest
import torch
from torch import nn

from saferun import modes
from saferun.guards import purity
from saferun.guards.purity import diff, find_inference_tensors, fingerprint
from saferun.guards.syncs import HostSyncCounter
from toys import Net


class ForcesTrainBN(nn.Module):
    """Planted bug: forward puts its BatchNorm back in train mode."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.backbone[1].train()
        return self.head(self.backbone(x))


class CountsCalls(nn.Module):
    """Planted bug: a custom buffer updated in every forward, eval included."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x)


class Cache(nn.Module):
    """Planted bug: in eval, keeps the last features as an attribute and in a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("last_mean", torch.zeros(4))
        self.memo = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            self.memo = x
            self.last_mean.copy_(x.mean(0))
        return x


class CachingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Linear(4, 4)
        self.cache = Cache()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.cache(self.features(x)))


def evaluate(model: nn.Module, grad_mode: str = "inference_mode") -> list[str]:
    """What saferun's validation does, bracketed by fingerprints."""
    before = fingerprint(model)
    with modes.evaluating(model, grad_mode):
        model(torch.randn(16, 4))
    return diff(before, fingerprint(model))


def test_clean_model_evaluates_without_a_finding():
    model = Net(dim=4)
    model(torch.randn(16, 4))  # train-mode forward: BN statistics are non-trivial
    assert evaluate(model) == []
    assert find_inference_tensors(model) == []


def test_batchnorm_forced_into_train_mode_is_named_with_the_cause():
    changes = evaluate(ForcesTrainBN())
    assert [c.split(" changed")[0] for c in changes] == [
        "buffer backbone.1.running_mean (BatchNorm1d)",
        "buffer backbone.1.running_var (BatchNorm1d)",
        "buffer backbone.1.num_batches_tracked (BatchNorm1d)",
    ]
    assert "Look for .train() or .training = True in forward" in changes[0]


def test_custom_buffer_updated_in_eval_is_named():
    [change] = evaluate(CountsCalls())
    assert change.startswith("buffer calls (CountsCalls) changed during evaluation: the module "
                             "writes it in forward even in eval mode")


def test_caching_module_is_caught_as_a_changed_buffer_and_an_inference_tensor():
    model = CachingNet()
    [change] = evaluate(model)
    assert change.startswith("buffer cache.last_mean (Cache) changed during evaluation")
    [leak] = find_inference_tensors(model)
    assert leak.startswith("attribute cache.memo (Cache) is an inference tensor")
    assert "trainer.eval_grad_mode=no_grad" in leak
    # Why it matters: the next training step that uses the cache fails with torch's bare error.
    model.train()
    with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
        model.head(model.cache.memo).sum().backward()
    # Under no_grad the same cache is a normal tensor.
    model = CachingNet()
    evaluate(model, "no_grad")
    assert find_inference_tensors(model) == []


def test_inference_tensors_are_found_in_buffers_parameters_and_nested_attributes():
    model = CachingNet()
    with torch.inference_mode():
        model.cache.last_mean = torch.ones(4)  # replaces the registered buffer
        model.head.history = [{"k": torch.ones(1)}]
        built_here = nn.Linear(2, 2)
    model.add_module("late", built_here)
    found = [f.split(" is an")[0] for f in find_inference_tensors(model)]
    assert found == ["buffer cache.last_mean (Cache)", "attribute head.history[0]['k'] (Linear)",
                     "parameter late.weight (Linear)", "parameter late.bias (Linear)"]
    assert "Build the model outside torch.inference_mode()" in find_inference_tensors(model)[-1]


def test_parameter_changed_added_and_removed_tensors_are_named():
    model = CountsCalls()
    before = fingerprint(model)
    with torch.no_grad():
        model.lin.weight[0, 0] += 1
    model.register_buffer("extra", torch.zeros(1))
    model.calls = None  # a registered buffer set to None
    changes = diff(before, fingerprint(model))
    assert changes[0].startswith("parameter lin.weight (Linear) changed during evaluation: look "
                                 "for an optimizer step")
    assert changes[1] == "buffer calls (CountsCalls) was removed (or set to None) during evaluation"
    assert changes[2].startswith("buffer extra (CountsCalls) was added during evaluation")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16,
                                   torch.int64, torch.uint8, torch.bool, torch.complex64])
def test_any_single_element_change_is_seen_in_every_dtype(dtype):
    t = torch.arange(24).reshape(4, 6).to(dtype)
    module = nn.Module()
    module.register_buffer("b", t)
    before = fingerprint(module)
    assert diff(before, fingerprint(module)) == []
    with torch.no_grad():
        t[2, 3] = 0 if dtype != torch.bool else True  # True->True would be no change
        if dtype == torch.bool:
            t[0, 0] = True  # element (0, 0) was False
    assert len(diff(before, fingerprint(module))) == 1


def test_checksums_are_bit_exact_nan_safe_and_see_moved_values():
    def changed(old: torch.Tensor, new: torch.Tensor) -> bool:
        a, b = nn.Module(), nn.Module()
        a.register_buffer("t", old)
        b.register_buffer("t", new)
        return bool(diff(fingerprint(a), fingerprint(b)))

    nan = float("nan")
    assert not changed(torch.tensor([nan, 1.0]), torch.tensor([nan, 1.0]))
    assert changed(torch.tensor([nan, 1.0]), torch.tensor([1.0, 1.0]))
    assert changed(torch.tensor([1.0, 1.0]), torch.tensor([1.0, nan]))
    one = torch.tensor([1.0])
    assert changed(one, torch.nextafter(one, torch.tensor([2.0])))  # one bit
    assert changed(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert changed(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2.0, 1.0, 3.0]))  # same sum
    assert changed(torch.arange(8.0), torch.arange(8.0).roll(1))  # a ring buffer moved on
    assert changed(torch.ones(3, 2), torch.ones(2, 3))
    assert not changed(torch.arange(6.0).reshape(2, 3).t(), torch.arange(6.0).reshape(2, 3).t())


def test_large_tensors_are_summed_in_chunks_to_the_same_checksum(monkeypatch):
    t = torch.randn(1001)
    whole = purity._checksum(t)
    monkeypatch.setattr(purity, "_CHUNK", 8)
    assert torch.equal(purity._checksum(t), whole)


def test_fingerprint_reads_nothing_and_diff_reads_once():
    model = ForcesTrainBN()
    with HostSyncCounter() as counter:
        before = fingerprint(model)
        with modes.evaluating(model):
            model(torch.randn(8, 4))
        after = fingerprint(model)
        assert counter.count == 0
        assert len(diff(before, after)) == 3
    assert counter.count == 1, counter.sites


def test_a_reshaped_or_retyped_tensor_is_named_with_both_layouts():
    module = nn.Module()
    module.register_buffer("queue", torch.ones(3, 2))
    before = fingerprint(module)
    module.queue = torch.ones(2, 3)
    [change] = diff(before, fingerprint(module))
    assert change.startswith("buffer queue (Module) changed during evaluation "
                             "(from float32[3, 2] to float32[2, 3])")
