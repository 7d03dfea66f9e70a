"""The loop's own clipping, measuring and zeroing (loop/update.py): torch's results, bit for bit.

`Gradients.norm` and `release_grads` take a direct path where the parameters allow it; each
case here compares it with torch's own function (clip_grad_norm_, get_total_norm,
Optimizer.zero_grad(set_to_none=True)) run on an identical copy.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import saferun
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


def test_a_part_cast_to_another_dtype_after_the_choice_gets_torchs_result_still():
    # Built on one dtype (the direct path), then two parameters cast in place, as
    # module.to(torch.bfloat16) inside training_step does mid-fit: torch groups the norms by
    # dtype, so summing them in parameter order differs in the last bits for some values
    # (summed in parameter order, 2 of these 200 sets did)
    differ = []
    for seed in range(200):
        ours = _params([torch.float32] * 5, seed=seed)
        gradients = Gradients(ours)
        assert gradients.direct
        for p in ours[1:3]:
            p.data = p.data.to(torch.bfloat16)
            p.grad = p.grad.to(torch.bfloat16)
        theirs = _copy(ours)
        norm = gradients.norm(0.5)
        if not (_same(norm, torch.nn.utils.clip_grad_norm_(theirs, 0.5))
                and all(_same(a.grad, b.grad) for a, b in zip(ours, theirs))):
            differ.append(seed)
    assert not differ


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


class _InOwnDtype(nn.Module):
    """A layer run in its own dtype (a block a user casts to bf16)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x.to(self.layer.weight.dtype)).float()


def _cast_model():
    torch.manual_seed(123)
    return nn.Sequential(*(m for i, o in ((8, 32), (32, 32), (32, 32)) for m in (
        _InOwnDtype(nn.Linear(i, o)), nn.Tanh())), _InOwnDtype(nn.Linear(32, 3)))


def test_a_block_cast_to_bf16_inside_training_step_trains_as_a_hand_written_loop(tmp_path):
    # The crossing of the direct path (chosen as fit() starts, all fp32) with a cast mid-fit:
    # every step's clipping must still be torch's, bit for bit (100 steps, clipping at 0.05,
    # showed a difference before the path was checked at each step)
    steps, size = 100, 16
    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps * size, 8, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()

    class Cast(saferun.Trainer):
        def build_model(self):
            return _cast_model()

        def build_datasets(self):
            return TensorDataset(x, y), None

        def build_optimizer(self, params):
            return torch.optim.SGD(params, lr=0.1)

        def training_step(self, batch):
            if self.model[2].layer.weight.dtype == torch.float32:
                self.model[2].to(torch.bfloat16)  # "run the middle block in bf16 from now on"
            inputs, targets = batch
            return F.cross_entropy(self.model(inputs), targets)

    trainer = Cast({"trainer": {"max_steps": steps, "batch_size": size, "device": "cpu",
                                "shuffle": False, "max_grad_norm": 0.05, "run_dir": str(tmp_path),
                                "log_every_n_steps": steps}, "seed": 0})
    trainer.fit()

    model = _cast_model()
    model[2].to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(steps):
        F.cross_entropy(model(x[i * size:(i + 1) * size]), y[i * size:(i + 1) * size]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad(set_to_none=True)
    ours, theirs = trainer.model.state_dict(), model.state_dict()
    assert [k for k in theirs if not torch.equal(ours[k], theirs[k])] == []
