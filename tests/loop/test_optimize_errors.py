"""Errors on the several-optimizer path, explained in the user's terms: an error in
training_step (the module, the batch, which optimize() call), the ordering slip and the shared
graph that autograd reports in its own words, retain_graph, and messages naming the optimizer.
The explanation's replay leaves the whole training state as the failure left it."""

import logging
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from saferun.errors import SaferunError
from test_optimizers import Scaled, TwoOptimizers, config


class Net(nn.Module):
    """TwoNet with a BatchNorm and a Dropout: the replay must restore buffers and RNG."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3))
        self.head = nn.Linear(16, 3)


def whole_state(t):
    """Parameters, buffers, gradients, every optimizer, scheduler and the scaler, and RNG."""
    return flat({"model": t.model.state_dict(), "grads": [p.grad for p in t.model.parameters()],
                 "optimizer": t.optimizer.state_dict(), "scheduler": t.scheduler.state_dict(),
                 "scaler": t.scaler.state_dict(), "torch_rng": torch.get_rng_state(),
                 "random": random.getstate(), "numpy": np.random.get_state()})


def flat(obj, path=""):
    """[(path, value)] with every tensor and array cloned, to compare exactly."""
    if isinstance(obj, dict):
        return [kv for k, v in obj.items() for kv in flat(v, f"{path}/{k}")]
    if isinstance(obj, (list, tuple)):
        return [kv for i, v in enumerate(obj) for kv in flat(v, f"{path}/{i}")]
    if isinstance(obj, torch.Tensor):
        return [(path, obj.detach().clone())]
    return [(path, obj.copy() if isinstance(obj, np.ndarray) else obj)]


def assert_same_state(a, b):
    assert [k for k, _ in a] == [k for k, _ in b]
    for (k, x), (_, y) in zip(a, b):
        same = (torch.equal(x, y) if isinstance(x, torch.Tensor) else
                np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y)
        assert same, k


def keep_first_state(t):
    """The state as the failing step left it, just before the failure (not in the replays of
    training_step that the explanation runs afterwards)."""
    if "at_failure" not in vars(t):
        t.at_failure = whole_state(t)


class FailsInForward(TwoOptimizers):
    """At step 2, after the head's update, the encoder's loss feeds the head a wrong width."""

    def build_model(self):
        return Net()

    def training_step(self, batch):
        x, y = batch
        h = self.model.enc(x)
        self.optimize("head", F.cross_entropy(self.model.head(h.detach()), y))
        if self.state.step + 1 == 2:
            h = torch.cat([h, h], dim=1)
            keep_first_state(self)
        self.optimize("enc", F.cross_entropy(self.model.head(h), y))


class InplaceInForward(TwoOptimizers):
    """A user's in-place operation on a tensor sigmoid saved: fails in optimize('enc')."""

    def build_model(self):
        return Net()

    def training_step(self, batch):
        x, y = batch
        h = self.model.enc(x)
        self.optimize("head", F.cross_entropy(self.model.head(h.detach()), y))
        z = torch.sigmoid(h)
        z.mul_(2.0)
        keep_first_state(self)
        self.optimize("enc", F.cross_entropy(self.model.head(z), y))


@pytest.mark.parametrize("trainer", [FailsInForward, type("Scaled", (Scaled, FailsInForward), {})])
def test_an_error_in_training_step_is_explained_and_the_replay_changes_nothing(tmp_path, trainer):
    t = trainer(config(tmp_path, max_steps=3))
    with pytest.raises(RuntimeError) as e:
        t.fit()
    text = str(e.value)
    assert "training_step failed at step 2: a shape mismatch in module 'head' (Linear)" in text
    assert "in module: 'head' (Linear) received input[0]: float32 (32, 32)" in text
    assert "raised from:" in text and "self.optimize(\"enc\", F.cross_entropy(self.model.head(h), y))" in text
    assert "batch:" in text and "shapes cannot be multiplied" in text
    assert isinstance(e.value.__cause__, RuntimeError) and t.state.step == 1
    assert_same_state(t.at_failure, whole_state(t))  # the replay stepped, moved, drew nothing


def test_an_error_in_an_optimize_calls_backward_names_the_optimizer_and_the_line(tmp_path):
    t = InplaceInForward(config(tmp_path, max_steps=2))
    with pytest.raises(RuntimeError) as e:
        t.fit()
    text = str(e.value)
    assert text.startswith("training_step failed at step 1, in self.optimize('enc', loss) "
                           "(the backward of its loss): an in-place operation"), text
    assert "z = torch.sigmoid(h)" in text  # the anomaly-mode replay names the forward line
    assert_same_state(t.at_failure, whole_state(t))


# ------------------------------------------------------------------ the two usual slips

class OrderingSlip(TwoOptimizers):
    """Both losses built first, then the updates: the encoder's loss goes through the head,
    whose update changes the weights that loss's graph saved."""

    fused = False

    def build_optimizer(self, params):
        return {"head": torch.optim.AdamW(self.model.head.parameters(), lr=0.1, fused=self.fused),
                "enc": torch.optim.SGD(self.model.enc.parameters(), lr=0.1)}

    def training_step(self, batch):
        x, y = batch
        h = self.model.enc(x)
        head_loss = F.cross_entropy(self.model.head(h.detach()), y)
        enc_loss = F.cross_entropy(self.model.head(h), y)
        self.optimize("head", head_loss)
        self.optimize("enc", enc_loss)


class FusedOrderingSlip(OrderingSlip):
    fused = True  # torch's fused AdamW changes the weights without bumping autograd's version


@pytest.mark.parametrize("trainer", [OrderingSlip, FusedOrderingSlip,
                                     type("Scaled", (Scaled, OrderingSlip), {})])
def test_the_ordering_slip_is_named_with_what_to_do_also_for_a_fused_optimizer(tmp_path, trainer):
    t = trainer(config(tmp_path, max_steps=2))
    with pytest.raises(RuntimeError) as e:
        t.fit()
    text = str(e.value)
    assert text.startswith("step 1: self.optimize('enc', loss) failed: its loss was computed "
                           "before self.optimize('head', ...) ran, and its backward needs the "
                           "values of [head.weight]"), text
    assert "compute each loss after the previous optimize() call" in text
    assert "modified by an inplace operation" in str(e.value.__cause__)


class SharedGraph(TwoOptimizers):
    """One loss for both optimizers: the head's backward passes the nodes the encoder's
    already ran (and freed, unless retain_graph)."""

    first, retain = "enc", False

    def build_optimizer(self, params):
        return {"head": torch.optim.SGD(self.model.head.parameters(), lr=0.1),
                "enc": torch.optim.SGD(self.model.enc.parameters(), lr=0.1)}

    def training_step(self, batch):
        x, y = batch
        loss = F.cross_entropy(self.model.head(self.model.enc(x)), y)
        self.seen = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        second = "head" if self.first == "enc" else "enc"
        self.optimize(self.first, loss, retain_graph=self.retain)
        self.optimize(second, loss)


def test_a_shared_graph_is_named_with_the_options(tmp_path):
    with pytest.raises(RuntimeError) as e:
        SharedGraph(config(tmp_path, max_steps=2)).fit()
    text = str(e.value)
    assert text.startswith("step 1: self.optimize('head', loss) failed: its backward goes through "
                           "part of a graph that self.optimize('enc', ...) already backpropagated"), text
    assert "self.optimize('enc', loss, retain_graph=True)" in text and ".detach()" in text
    assert "backward through the graph a second time" in str(e.value.__cause__)


@pytest.mark.parametrize("base", [SharedGraph, type("Scaled", (Scaled, SharedGraph), {})])
def test_retain_graph_gives_each_optimizer_the_gradient_of_the_loss_as_computed(tmp_path, base):
    """Allowed: the head's gradient needs only the encoder's output, which the encoder's update
    left as it was: both updates equal plain SGD on the gradients taken before either."""
    t = base(config(tmp_path, max_steps=1, max_grad_norm=None))
    t.retain = True
    t.setup()
    x, y = next(iter(t.train_loader))
    expected = {}
    model = type(t.model)()
    model.load_state_dict(t.model.state_dict())
    loss = F.cross_entropy(model.head(model.enc(x)), y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    for (n, p), g in zip(model.named_parameters(), grads):
        expected[n] = torch.add(p.detach(), g, alpha=-0.1)
    t.fit()
    got = dict(t.model.named_parameters())
    for n in expected:
        assert torch.equal(got[n].detach(), expected[n]), n


def test_retain_graph_is_refused_when_the_later_backward_needs_the_updated_weights(tmp_path):
    t = SharedGraph(config(tmp_path, max_steps=1))
    t.first, t.retain = "head", True  # the encoder's gradient needs the head's weight
    with pytest.raises(RuntimeError, match=r"step 1: self.optimize\('enc', loss\) failed: its "
                       r"loss was computed before self.optimize\('head', ...\) ran") as e:
        t.fit()
    assert "retain_graph=True does not change this" in str(e.value)



class InplaceLikeAParameter(TwoOptimizers):
    """After the head's update, a user's in-place op on an activation that has head.weight's
    shape and, in-place op by op, its version: autograd's error names that activation (the
    output of Sigmoid), which no parameter can be; it is not the ordering slip."""

    def build_optimizer(self, params):
        return {"head": torch.optim.SGD(self.model.head.parameters(), lr=0.1),
                "enc": torch.optim.SGD(self.model.enc.parameters(), lr=0.1)}

    def training_step(self, batch):
        x, y = batch
        h = self.model.enc(x)
        self.optimize("head", F.cross_entropy(self.model.head(h.detach()), y))
        z = torch.sigmoid(h[:3])  # (3, 16), as head.weight
        for _ in range(self.model.head.weight._version):
            z.mul_(1.0)
        self.optimize("enc", F.cross_entropy(self.model.head(torch.cat([z, h[3:]])), y))


def test_a_users_inplace_op_matching_a_parameters_shape_and_version_is_not_the_slip(tmp_path):
    with pytest.raises(RuntimeError) as e:
        InplaceLikeAParameter(config(tmp_path, max_steps=1)).fit()
    text = str(e.value)
    assert "output 0 of Sigmoid, is at version" in text  # the collision this test is about
    assert "before self.optimize('head', ...) ran" not in text, text
    assert text.startswith("training_step failed at step 1, in self.optimize('enc', loss) "
                           "(the backward of its loss): an in-place operation"), text
    assert "z = torch.sigmoid(h[:3])" in text  # the anomaly-mode replay names the forward line


# ------------------------------------------------------------------ messages name the optimizer

class NotReduced(TwoOptimizers):
    def training_step(self, batch):
        x, y = batch
        h = self.model.enc(x)
        self.optimize("head", F.cross_entropy(self.model.head(h.detach()), y, reduction="none"))


class Detached(TwoOptimizers):
    def training_step(self, batch):
        x, y = batch
        h = self.model.enc(x)
        self.optimize("head", F.cross_entropy(self.model.head(h.detach()), y).detach())


class PassesDict(TwoOptimizers):
    def training_step(self, batch):
        x, y = batch
        self.optimize("head", {"loss": F.cross_entropy(self.model.head(self.model.enc(x)), y)})


@pytest.mark.parametrize("trainer, words", [
    (NotReduced, "step 1: self.optimize('head', loss) needs a scalar loss tensor; got shape (32,). "
                 "Reduce it over the batch"),
    (Detached, "step 1: the loss given to self.optimize('head', loss) does not require grad, so "
               "backward() cannot train optimizer 'head'"),
    (PassesDict, "step 1: self.optimize('head', loss) got a dict; pass the loss tensor itself"),
])
def test_a_loss_that_cannot_train_names_the_optimizer_and_the_step(tmp_path, trainer, words):
    with pytest.raises(SaferunError) as e:
        trainer(config(tmp_path, max_steps=1)).fit()
    assert words in str(e.value)


def test_the_frozen_parameter_warning_names_the_optimizer(tmp_path, caplog):
    class Frozen(TwoOptimizers):
        def build_model(self):
            model = super().build_model()
            model.head.bias.requires_grad_(False)
            return model

    with caplog.at_level(logging.WARNING, logger="saferun"):
        Frozen(config(tmp_path, max_steps=1)).setup()
    said = [r.getMessage() for r in caplog.records if "frozen parameters" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(
        "the optimizer 'head' (self.optimize('head', loss)) also holds 1 frozen parameters (["
        "head.bias]"), said


class HeadOnOnlyForItsStep(TwoOptimizers):
    """A GAN's habit: the discriminator (here the head) frozen in build_model, switched on by
    training_step for its own optimize() and off again for the other's."""

    def build_model(self):
        model = super().build_model()
        model.head.requires_grad_(False)
        return model

    def training_step(self, batch):
        x, y = batch
        h = self.model.enc(x)
        self.model.head.requires_grad_(True)
        self.optimize("head", F.cross_entropy(self.model.head(h.detach()), y))
        self.model.head.requires_grad_(False)
        self.optimize("enc", F.cross_entropy(self.model.head(h), y))


def test_an_optimizer_over_only_frozen_parameters_is_refused_at_setup(tmp_path):
    """Each optimize() backpropagates into the parameters its optimizer held trainable when
    training started: one switched on only inside training_step would train nothing (autograd's
    bare "inputs cannot be empty" at step 1, before). Refused before training, with the way out."""
    t = HeadOnOnlyForItsStep(config(tmp_path))
    with pytest.raises(SaferunError) as info:
        t.setup()
    message = str(info.value)
    assert message.startswith("build_optimizer: 'head' holds only frozen parameters")
    assert "head.weight" in message and "trainable in build_model" in message
    assert t.state.step == 0


class StepRaises(torch.optim.SGD):
    """An optimizer whose step fails at the loop's second step (a user's optimizer bug)."""

    def step(self, closure=None):
        if self.state.get("calls", 0) == 1:
            raise ValueError("momentum buffer has the wrong shape")
        self.state["calls"] = self.state.get("calls", 0) + 1
        return super().step(closure)


class TwoOptimizersOneFailing(TwoOptimizers):
    def build_optimizer(self, params):
        optimizers = super().build_optimizer(params)
        optimizers["head"] = StepRaises(self.model.head.parameters(), lr=0.1)
        return optimizers


def test_an_error_in_an_optimizers_step_names_the_call_and_the_step(tmp_path):
    """The loop records where in optimize() a failure happened: here the optimizer's step."""
    t = TwoOptimizersOneFailing(config(tmp_path, max_steps=3))
    with pytest.raises(ValueError) as e:
        t.fit()
    assert str(e.value).startswith("training_step failed at step 2, in self.optimize('head', "
                                   "loss) (its optimizer's step):"), str(e.value)
    assert isinstance(e.value.__cause__, ValueError)
