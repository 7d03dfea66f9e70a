"""Parameters that become trainable after fit() started are refused at the next log point:
the optimizer, the clip and the gradient norm cover only those trainable at the start, so an
unfrozen or added parameter would look trained and not be (guards/trainable.py)."""

import pytest
import torch
from torch import nn

import saferun
from toys import ToyTrainer, toy_config


class Unfreeze(saferun.Callback):
    """At the end of step `at`, `change(model)`: the user's mid-run course change (a callback
    built with its trainer's model, as a user's own would be)."""

    def __init__(self, at, change):
        self.at, self.change, self.model = at, change, None

    def on_train_step_end(self, view, output):
        if view.step == self.at:
            self.change(self.model)


def run(tmp_path, change, at=3, trainer=ToyTrainer, **kw):
    cb = Unfreeze(at, change)
    t = trainer(toy_config(tmp_path, max_steps=20, log_every_n_steps=5, **kw), callbacks=[cb])
    t.setup()
    cb.model = t.model
    return t, t.fit


def test_a_module_of_frozen_modules_unfrozen_mid_run_is_refused_at_the_next_log_point(tmp_path):
    t, fit = run(tmp_path, lambda m: m.backbone.requires_grad_(True), frozen_modules=["backbone"])
    with pytest.raises(saferun.SaferunError) as info:
        fit()
    message = str(info.value)
    assert message.startswith("step 5: parameters became trainable after training started")
    assert "backbone.0.weight" in message and "backbone.1.bias" in message
    assert "head.weight" not in message  # trainable from the start
    assert "its own run" in message  # what to do instead


def test_a_module_frozen_by_hand_and_in_the_optimizer_is_refused_too(tmp_path):
    """The user's optimizer holds every parameter (torch's optimizers skip those without a
    gradient), so the unfrozen ones would step, but outside the clip and the gradient norm."""
    class HandFrozen(ToyTrainer):
        def build_model(self):
            model = super().build_model()
            model.backbone.requires_grad_(False)
            return model

        def build_optimizer(self, params):
            return torch.optim.SGD(self.model.parameters(), lr=0.05)

    t, fit = run(tmp_path, lambda m: m.backbone.requires_grad_(True), trainer=HandFrozen,
                 max_grad_norm=1e-3)
    with pytest.raises(saferun.SaferunError, match="backbone.0.weight"):
        fit()


def test_a_layer_added_mid_run_is_refused(tmp_path):
    def add(model):
        model.extra = nn.Linear(3, 3)

    _, fit = run(tmp_path, add, at=6)
    with pytest.raises(saferun.SaferunError, match=r"step 10: .*\[extra.weight, extra.bias\]"):
        fit()


def test_freezing_mid_run_is_fine_and_the_frozen_part_stays_as_it_was(tmp_path):
    kept = {}

    def freeze(model):
        model.backbone.requires_grad_(False)
        kept.update({k: v.clone() for k, v in model.backbone.named_parameters()})

    t, fit = run(tmp_path, freeze, at=3)
    head = t.model.head.weight.detach().clone()
    fit()
    assert t.state.step == 20 and kept
    assert all(torch.equal(kept[k], v) for k, v in t.model.backbone.named_parameters())
    assert not torch.equal(head, t.model.head.weight)  # the rest trained on


def test_unfreezing_between_two_fits_is_refused_in_the_second(tmp_path):
    t = ToyTrainer(toy_config(tmp_path, max_steps=10, log_every_n_steps=5,
                              frozen_modules=["backbone"]))
    t.fit()
    t.model.backbone.requires_grad_(True)
    t.cfg.trainer.max_steps = 20
    with pytest.raises(saferun.SaferunError, match="step 15: parameters became trainable"):
        t.fit()


class TogglesTheBackbone(ToyTrainer):
    """Trains the frozen backbone on every other step by turning requires_grad on inside
    training_step, and off again on the steps between: off at every log point."""

    def training_step(self, batch):
        self.model.backbone.requires_grad_(self.state.step % 2 == 0)  # on for steps 1, 3, 5...
        return super().training_step(batch)


def test_a_module_unfrozen_inside_training_step_and_frozen_at_log_points_is_refused(tmp_path):
    """Off at each log point, the backbone got gradients on half the steps, which the optimizer
    (built from the parameters trainable at the start) never applied: they linger in .grad."""
    t = TogglesTheBackbone(toy_config(tmp_path, max_steps=20, log_every_n_steps=4,
                                      frozen_modules=["backbone"]))
    with pytest.raises(saferun.SaferunError) as info:
        t.fit()
    message = str(info.value)
    assert message.startswith("step 4: parameters became trainable after training started")
    assert "backbone.0.weight" in message and "head.weight" not in message
    assert "gradient" in message  # how it was seen: not requires_grad (off now), its gradient


class HandFrozenInAdamW(ToyTrainer):
    """The backbone frozen by hand (`freeze`), the user's AdamW over every parameter."""

    freeze, toggle = True, False

    def build_model(self):
        model = super().build_model()
        model.backbone.requires_grad_(not self.freeze)
        return model

    def build_optimizer(self, params):
        return torch.optim.AdamW(self.model.parameters(), lr=0.01)

    def training_step(self, batch):
        if self.toggle:  # on for steps 1, 3, 5..., off at every log point
            self.model.backbone.requires_grad_(self.state.step % 2 == 0)
        return super().training_step(batch)


def test_a_module_in_the_users_optimizer_switched_on_inside_training_step_is_refused(tmp_path):
    """The user's optimizer steps the backbone on the steps it is on, outside the clip, and
    zero_grad leaves no gradient behind: seen by the optimizer state it got."""
    t = type("Toggles", (HandFrozenInAdamW,), {"toggle": True})(
        toy_config(tmp_path, max_steps=20, log_every_n_steps=4, max_grad_norm=1e-3))
    with pytest.raises(saferun.SaferunError, match=r"^step 4: .*backbone\.0\.weight"):
        t.fit()


def test_freezing_at_a_resume_is_fine_though_the_optimizer_holds_state_for_the_frozen_part(tmp_path):
    """Trained whole, then resumed with the backbone frozen: the checkpoint's AdamW state for
    the backbone is from before, not an update since, and the backbone stays as it was."""
    first = type("Whole", (HandFrozenInAdamW,), {"freeze": False})(
        toy_config(tmp_path, max_steps=8, log_every_n_steps=4))
    first.fit()
    kept = {k: v.detach().clone() for k, v in first.model.named_parameters()}
    t = HandFrozenInAdamW({**toy_config(tmp_path, max_steps=16, log_every_n_steps=4),
                           "resume": "auto"})
    t.fit()
    assert t.state.step == 16
    now = dict(t.model.named_parameters())
    assert all(torch.equal(kept[k], now[k]) for k in kept if k.startswith("backbone."))
    assert not torch.equal(kept["head.weight"], now["head.weight"])  # the rest trained on


def test_an_unfreeze_after_the_last_regular_log_point_is_refused_at_the_runs_last_step(tmp_path):
    """max_steps not a multiple of log_every_n_steps: the steps after step 20 still get their
    log point, at the run's last step, before the final save calls the run done."""
    cb = Unfreeze(21, lambda m: m.backbone.requires_grad_(True))
    t = ToyTrainer(toy_config(tmp_path, max_steps=22, log_every_n_steps=5,
                              frozen_modules=["backbone"]), callbacks=[cb])
    t.setup()
    cb.model = t.model
    with pytest.raises(saferun.SaferunError, match="^step 22: parameters became trainable"):
        t.fit()


class TwoOptimizersFrozenBias(ToyTrainer):
    """Several optimizers (the manual path): "body" holds the backbone, whose first layer's bias
    is frozen by hand, "head" the head; each loss is its own optimize()."""

    def build_model(self):
        model = super().build_model()
        model.backbone[0].bias.requires_grad_(False)
        return model

    def build_optimizer(self, params):
        return {"body": torch.optim.AdamW(self.model.backbone.parameters(), lr=0.01),
                "head": torch.optim.SGD(self.model.head.parameters(), lr=0.05)}

    def training_step(self, batch):
        x, y = batch
        h = self.model.backbone(x)
        self.optimize("head", torch.nn.functional.cross_entropy(self.model.head(h.detach()), y))
        self.optimize("body", torch.nn.functional.cross_entropy(self.model.head(h), y))


def test_several_optimizers_an_unfreeze_mid_run_is_refused_too(tmp_path):
    _, fit = run(tmp_path, lambda m: m.backbone[0].bias.requires_grad_(True), at=7,
                 trainer=TwoOptimizersFrozenBias)
    with pytest.raises(saferun.SaferunError, match=r"^step 10: .*\[backbone\.0\.bias\]"):
        fit()
