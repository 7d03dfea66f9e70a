"""What the installed torch really does, for the behaviours saferun relies on.

docs/pytorch.md states each behaviour and names its test here; several contradict popular
beliefs. If a torch release changes one, its test fails here before saferun misbehaves.
"""

import math
import pickle
import threading

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


def test_eval_mode_does_not_turn_off_autograd_but_no_grad_does():
    layer = nn.Linear(3, 2).eval()
    x = torch.randn(4, 3)
    assert layer(x).grad_fn is not None
    with torch.no_grad():
        assert layer(x).grad_fn is None


def test_dropout_is_the_identity_in_eval_mode_only():
    drop = nn.Dropout(0.5)
    x = torch.ones(1000)
    assert torch.equal(drop.eval()(x), x)
    assert (drop.train()(x) == 0).any()


def test_batchnorm_in_eval_mode_leaves_its_statistics_alone_even_after_backward():
    bn = nn.BatchNorm1d(3).eval()
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    bn(torch.randn(8, 3) * 5 + 2).sum().backward()
    assert all(torch.equal(before[k], v) for k, v in bn.state_dict().items())


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_batchnorm_in_train_mode_updates_its_statistics_under_no_grad_and_inference_mode(context):
    bn = nn.BatchNorm1d(3).train()
    with context():
        bn(torch.randn(8, 3) + 5)
    assert bn.num_batches_tracked.item() == 1 and bn.running_mean.abs().sum() > 0


def test_model_train_unfreezes_a_backbone_frozen_by_eval_and_requires_grad_false():
    model = nn.Sequential(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)), nn.Linear(3, 1))
    backbone = model[0]
    backbone.eval().requires_grad_(False)
    model.train()  # what a hand-written loop calls after validation
    assert backbone.training and backbone[1].training
    before = backbone[1].running_mean.clone()
    model(torch.randn(8, 3) + 3)
    assert not torch.equal(before, backbone[1].running_mean)  # requires_grad=False did not stop it


def test_no_grad_is_per_thread():
    seen = {}
    with torch.no_grad():
        other = threading.Thread(target=lambda: seen.update(enabled=torch.is_grad_enabled()))
        other.start()
        other.join()
        assert not torch.is_grad_enabled()
    assert seen["enabled"]


def test_zero_grad_sets_gradients_to_none_and_gradients_accumulate_until_then():
    layer = nn.Linear(2, 1)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    x = torch.ones(1, 2)
    layer(x).sum().backward()
    once = layer.weight.grad.clone()
    layer(x).sum().backward()
    assert torch.equal(layer.weight.grad, 2 * once)
    opt.zero_grad()
    assert layer.weight.grad is None


def test_clipping_with_an_infinite_max_norm_turns_every_gradient_into_nan_when_one_is_inf():
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    a.grad, b.grad = torch.tensor([math.inf, 1.0]), torch.tensor([1.0, 2.0])
    norm = torch.nn.utils.clip_grad_norm_([a, b], math.inf)
    assert norm.isinf() and b.grad.isnan().all()  # b's finite gradient is lost too
    a.grad, b.grad = torch.tensor([math.inf, 1.0]), torch.tensor([1.0, 2.0])
    assert torch.nn.utils.get_total_norm([a.grad, b.grad]).isinf()  # measuring only:
    assert torch.equal(b.grad, torch.tensor([1.0, 2.0]))  # the gradients are left as they were


@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled")
def test_detect_anomaly_raises_on_nan_but_not_on_inf():
    x = torch.tensor([0.0], requires_grad=True)
    with torch.autograd.detect_anomaly(), pytest.warns(UserWarning):  # the forward's traceback
        with pytest.raises(RuntimeError, match="returned nan"):
            (x.log() * 0).sum().backward()  # at 0: log's gradient inf times 0 = nan
    y = torch.tensor([0.0], requires_grad=True)
    with torch.autograd.detect_anomaly():
        y.log().sum().backward()  # gradient inf: no error
    assert y.grad.isinf().all()


def test_tensors_made_under_inference_mode_cannot_be_saved_for_backward():
    head = nn.Linear(3, 1)
    with torch.inference_mode():
        features = torch.randn(2, 3)
    assert features.is_inference()
    with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
        head(features).sum().backward()
    head(features.clone()).sum().backward()  # a clone outside the mode is a normal tensor


def test_inference_mode_does_not_put_a_model_in_eval_mode():
    model = nn.Dropout(0.5).train()
    with torch.inference_mode():
        assert model.training


def test_edits_through_data_give_silently_wrong_gradients_while_detach_raises():
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    y = (x * x).sum()
    x.data += 1  # the graph saved x; its value changed behind autograd's back
    y.backward()
    assert torch.equal(x.grad, torch.tensor([4.0, 6.0]))  # 2 * (x + 1), not 2 * x: no error
    z = torch.tensor([1.0, 2.0], requires_grad=True)
    w = (z * z).sum()
    z.detach().add_(1)  # the same edit, seen by the version counter
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        w.backward()


def test_where_gives_nan_gradients_from_the_branch_it_masks_out():
    x = torch.tensor([0.0, 1.0], requires_grad=True)
    torch.where(x > 0, x.sqrt(), torch.zeros_like(x)).sum().backward()
    assert x.grad[0].isnan()  # 0 * inf from sqrt's derivative at 0, although that branch is unused


class Draws(Dataset):
    def __init__(self):
        self.generator = np.random.default_rng(0)  # an object on the dataset: copied to every worker

    def __len__(self):
        return 2

    def __getitem__(self, i):
        global_draws = (np.random.rand(), torch.rand(1).item(), __import__("random").random())
        return torch.tensor([*global_draws, self.generator.random()])


def test_workers_draw_differently_from_global_rngs_but_alike_from_a_generator_on_the_dataset():
    loader = DataLoader(Draws(), batch_size=1, num_workers=2, multiprocessing_context="fork")
    first, second = (batch[0] for batch in loader)  # item 0 from worker 0, item 1 from worker 1
    assert (first[:3] != second[:3]).all()  # numpy, torch and random: seeded per worker by torch
    assert first[3] == second[3]  # the generator object is the same copy in both workers


def test_a_lambda_does_not_pickle_so_spawned_workers_cannot_receive_it():
    with pytest.raises((pickle.PicklingError, AttributeError)):
        pickle.dumps(lambda x: x)
