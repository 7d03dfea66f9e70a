"""The loop's own clipping, measuring and zeroing (loop/update.py): torch's results, bit for bit.

`Gradients.norm` and `release_grads` take a direct path where the parameters allow it; each
case here compares it with torch's own function (clip_grad_norm_, get_total_norm,
Optimizer.zero_grad(set_to_none=True)) run on an identical copy.
"""

import pytest
import torch
from torch import nn

from saferun.loop.update import Gradients, release_grads


def _params(dtypes, seed=0, grads="random"):
    """Parameters of the given dtypes with gradients: random, some None, or non-finite."""
    g = torch.Generator().manual_seed(seed)
    params = []
    for i, dtype in enumerate(dtypes):
        p = nn.Parameter(torch.randn(7 + 3 * i, 5, generator=g).to(dtype))
        p.grad = (torch.randn(p.shape, generator=g) * (i + 1)).to(dtype)
        params.append(p)
    if grads == "some None":
        params[1].grad = None
    elif grads == "inf":
        params[0].grad[2, 3] = float("inf")
    elif grads == "nan":
        params[-1].grad[0, 0] = float("nan")
    elif grads == "zero":
        for p in params:
            p.grad.zero_()
    return params


def _copy(params):
    """Identical parameters with identical gradients (deepcopy leaves a parameter's .grad out)."""
    copies = [nn.Parameter(p.detach().clone()) for p in params]
    for c, p in zip(copies, params):
        c.grad = None if p.grad is None else p.grad.clone()
    return copies


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        torch.nan_to_num(a, nan=7.0), torch.nan_to_num(b, nan=7.0)) and bool(
        (a.isnan() == b.isnan()).all())


DTYPES = {"fp32": [torch.float32] * 3, "bf16": [torch.bfloat16] * 3, "fp16": [torch.float16] * 2,
          "fp32+bf16": [torch.float32, torch.bfloat16, torch.float32]}


@pytest.mark.parametrize("max_norm", [1.0, 0.01, 1e6, None])
@pytest.mark.parametrize("grads", ["random", "some None", "inf", "nan", "zero"])
@pytest.mark.parametrize("dtypes", list(DTYPES))
def test_the_norm_and_the_clipped_gradients_equal_torchs_bit_for_bit(dtypes, grads, max_norm):
    ours = _params(DTYPES[dtypes], grads=grads)
    theirs = _copy(ours)
    gradients = Gradients(ours)
    assert gradients.direct == (dtypes != "fp32+bf16")  # one dtype on the CPU: the direct path
    norm = gradients.norm(max_norm)
    if max_norm is None:
        expected = torch.nn.utils.get_total_norm([p.grad for p in theirs if p.grad is not None])
    else:
        expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert _same(norm, expected)
    for a, b in zip(ours, theirs):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            assert _same(a.grad, b.grad)


def test_no_gradients_at_all_give_torchs_zero_norm_and_touch_nothing():
    ours = [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))]
    norm = Gradients(ours).norm(1.0)
    assert _same(norm, torch.nn.utils.clip_grad_norm_(_copy(ours), 1.0))
    assert all(p.grad is None for p in ours)


def test_the_norm_records_no_graph_and_leaves_the_grad_mode_as_it_found_it():
    # gradients that require grad (a backward with create_graph=True): torch's functions run
    # under no_grad, so the norm is a plain tensor; so is ours, and grad mode is back on after
    p = nn.Parameter(torch.randn(4))
    (p.grad,) = torch.autograd.grad((p ** 3).sum(), p, create_graph=True)
    assert p.grad.requires_grad
    norm = Gradients([p]).norm(0.5)
    assert torch.is_grad_enabled()
    assert not norm.requires_grad
    with torch.no_grad():
        Gradients([p]).norm(None)
        assert not torch.is_grad_enabled()


def test_only_one_plain_set_of_tensors_takes_the_direct_path():
    plain = _params([torch.float32] * 2)
    assert Gradients(plain).direct
    assert not Gradients(plain, meshes=True).direct  # DTensors on several meshes: torch's
    assert not Gradients(_params([torch.float32, torch.bfloat16])).direct
    meta = [nn.Parameter(torch.empty(3, device="meta"))]
    assert not Gradients(meta).direct  # no foreach kernels promised there

    class Tagged(torch.Tensor):  # a tensor subclass: torch's functions decide how
        pass

    tagged = nn.Parameter(torch.ones(2).as_subclass(Tagged))
    assert not Gradients(plain + [tagged]).direct


def _optimizer_with_grads(cls=torch.optim.AdamW):
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    extra = nn.Parameter(torch.ones(2))  # held by the optimizer, not by the model
    opt = cls([{"params": model.parameters()}, {"params": [extra], "lr": 0.1}])
    for p in [*model.parameters(), extra]:
        p.grad = torch.ones_like(p)
    model[0].bias.grad = None
    return opt, [*model.parameters(), extra]


def test_releasing_sets_every_gradient_the_optimizer_holds_to_none():
    opt, params = _optimizer_with_grads()
    release_grads(opt)
    assert all(p.grad is None for p in params)


def test_an_optimizer_class_with_its_own_zero_grad_gets_it_called():
    calls = []

    class Counting(torch.optim.SGD):
        def zero_grad(self, set_to_none=True):
            calls.append(set_to_none)
            super().zero_grad(set_to_none=set_to_none)

    opt, params = _optimizer_with_grads(Counting)
    opt.zero_grad = lambda **_: pytest.fail("the instance's attribute (the habits' refusal) ran")
    release_grads(opt)
    assert calls == [True]
    assert all(p.grad is None for p in params)


def test_under_the_profiler_torchs_zero_grad_runs_so_the_trace_names_it():
    opt, params = _optimizer_with_grads()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        release_grads(opt)
    assert any(e.name == "Optimizer.zero_grad#AdamW.zero_grad" for e in prof.events())
    assert all(p.grad is None for p in params)
