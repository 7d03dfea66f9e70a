"""Several named optimizers driven by training_step (`self.optimize(name, loss)`): the same
discipline as one optimizer, per optimizer, compared with a hand-written loop; logs per
optimizer; no host sync per step; the non-finite policies; refusals; resume by name."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import saferun
from helpers import cpu_grad_scaler
from saferun.checkpoint import CheckpointError
from saferun.errors import ConfigError, NonFiniteError, SaferunError
from saferun.guards.syncs import HostSyncCounter
from toys import ToyTrainer, make_classification, toy_config, weights

STEPS = 12  # 256 samples / 32: 8 steps per epoch, so the run crosses an epoch


class TwoNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 3)


class TwoOptimizers(ToyTrainer):
    """The head learns on the encoder's detached features, then the encoder learns through
    the head that just stepped (the shape of a GAN's update: the second loss crosses the
    first optimizer's parameters, which must get none of its gradient)."""

    nan_in, nan_at = "", -1

    def build_model(self):
        return TwoNet()

    def build_datasets(self):
        x, y = make_classification(256)
        return TensorDataset(x, y), None

    def build_optimizer(self, params):
        return {"head": torch.optim.SGD(self.model.head.parameters(), lr=0.1, momentum=0.9),
                "enc": torch.optim.AdamW(self.model.enc.parameters(), lr=1e-2, weight_decay=0.1)}

    def training_step(self, batch):
        x, y = batch
        h = self.model.enc(x)
        bad = {n: float("nan") if (n == self.nan_in and self.state.step + 1 == self.nan_at) else 0.0
               for n in ("head", "enc")}
        self.optimize("head", F.cross_entropy(self.model.head(h.detach()), y) + bad["head"])
        self.optimize("enc", F.cross_entropy(self.model.head(h), y) + bad["enc"])
        return {"feature_norm": h.detach().norm(dim=1).mean()}


def config(tmp_path, **trainer):
    cfg = toy_config(tmp_path, **{"max_steps": STEPS, "shuffle": False, "max_grad_norm": 0.5,
                                  "log_every_n_steps": 4, **trainer})
    cfg["sched"] = {"_target_": "torch.optim.lr_scheduler.StepLR", "step_size": 5, "gamma": 0.5}
    return cfg


def hand_written(initial, scale=None):
    """The same two updates per batch, written out (scale: a GradScaler's fixed loss scale)."""
    model = TwoNet()
    model.load_state_dict(initial)
    head = torch.optim.SGD(model.head.parameters(), lr=0.1, momentum=0.9)
    enc = torch.optim.AdamW(model.enc.parameters(), lr=1e-2, weight_decay=0.1)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5) for o in (head, enc)]
    x, y = make_classification(256)
    step = 0
    while step < STEPS:
        for xb, yb in DataLoader(TensorDataset(x, y), batch_size=32):
            h = model.enc(xb)
            # (B023 is a false alarm: each lambda is called in this iteration, before h and yb change)
            for opt, module, loss in ((head, model.head, lambda: F.cross_entropy(model.head(h.detach()), yb)),  # noqa: B023
                                      (enc, model.enc, lambda: F.cross_entropy(model.head(h), yb))):  # noqa: B023
                params = list(module.parameters())
                (loss() * (scale or 1.0)).backward(inputs=params)
                if scale:
                    for p in params:
                        p.grad.div_(scale)
                torch.nn.utils.clip_grad_norm_(params, 0.5)
                opt.step()
                opt.zero_grad(set_to_none=True)
            for s in scheds:
                s.step()
            step += 1
            if step == STEPS:
                break
    return model, head, enc


class Scaled(TwoOptimizers):
    """A real, enabled GradScaler on the CPU (fp16 autocast needs CUDA; the scaler's part of
    the step is the same): loss scaling, unscale_ per optimizer before its clip."""

    def setup(self):
        with cpu_grad_scaler(init_scale=2.0**10, growth_interval=1000):
            super().setup()


@pytest.mark.parametrize("trainer", [TwoOptimizers, Scaled])
def test_each_update_equals_a_hand_written_loop_bitwise(tmp_path, trainer):
    t = trainer(config(tmp_path))
    t.setup()
    initial = weights(t)
    t.fit()
    model, head, enc = hand_written(initial, scale=2.0**10 if trainer is Scaled else None)
    expected = {k: v.detach() for k, v in model.state_dict().items()}
    got = weights(t)
    assert list(got) == list(expected)
    for k in expected:
        assert torch.equal(got[k], expected[k]), k
    for name, opt in (("head", head), ("enc", enc)):
        mine, theirs = t.optimizer[name].state_dict(), opt.state_dict()
        assert mine["param_groups"] == theirs["param_groups"]
        for i, state in theirs["state"].items():
            for key, value in state.items():
                assert torch.equal(torch.as_tensor(mine["state"][i][key]), torch.as_tensor(value))
    assert all(p.grad is None for p in t.model.parameters())  # zero_grad(set_to_none=True)
    if trainer is Scaled:  # the step used the Trainer's scaler: one update() per step, none skipped
        # (its fixed power-of-two scale leaves the weights bitwise the same as unscaled ones)
        assert t.scaler.state_dict()["_growth_tracker"] == STEPS


def test_logs_name_each_optimizer_and_steps_read_nothing_from_the_device(tmp_path):
    logged = []

    class Logged(saferun.Callback):
        def on_log(self, view, metrics):
            logged.append(dict(metrics))

    t = TwoOptimizers(config(tmp_path), callbacks=[Logged()])
    with HostSyncCounter() as counter:
        t.fit()
    # one read per log point and one for the final save's check of the state, none per step
    assert counter.count == STEPS // 4 + 1, counter.sites
    last = logged[-1]
    for name in ("head", "enc"):
        assert math.isfinite(last[f"train/loss/{name}"]) and last[f"train/grad_norm/{name}"] > 0
    # StepLR(5, 0.5) per optimizer: step 12 used the rate after two decays
    assert last["train/lr/head"] == pytest.approx(0.1 * 0.25)
    assert last["train/lr/enc"] == pytest.approx(1e-2 * 0.25)
    assert "train/feature_norm" in last
    total = math.hypot(last["train/grad_norm/head"], last["train/grad_norm/enc"])
    assert last["train/grad_norm"] == pytest.approx(total, rel=0.2)  # a mean of per-step totals


def test_raise_policy_names_the_step_of_a_non_finite_loss(tmp_path):
    t = TwoOptimizers(config(tmp_path))
    t.nan_in, t.nan_at = "enc", 3
    with pytest.raises(NonFiniteError, match="non-finite values at step 3") as e:
        t.fit()
    # named: the encoder's loss (a NaN added to it leaves its gradients finite), not the head's
    assert "(not finite: train/loss/enc);" in str(e.value)


def test_skip_policy_drops_only_the_bad_optimizers_update(tmp_path):
    cfg = config(tmp_path)
    cfg["guards"] = {"nonfinite": "skip"}
    seen = {}

    class Snapshots(saferun.Callback):
        def on_train_step_end(self, view, output):
            seen[view.step] = (weights(t), output.skipped, t.optimizer["enc"].param_groups[0]["lr"])

    t = TwoOptimizers(cfg, callbacks=[Snapshots()])
    t.nan_in, t.nan_at = "enc", 5
    metrics = t.fit()
    before, after = seen[4][0], seen[5][0]
    assert seen[5][1] and not seen[4][1] and not seen[6][1]
    for k in before:
        changed = not torch.equal(before[k], after[k])
        assert changed == k.startswith("head"), k  # the head's update stands, the encoder's not
    # enc's scheduler did not step for the dropped update: its decay comes one step later
    assert seen[5][2] == seen[4][2] == 1e-2 and seen[6][2] == 5e-3
    assert metrics["train/loss/enc"] == metrics["train/loss/enc"]  # finite again after the skip


def test_a_module_switched_to_eval_in_training_step_is_named_with_several_optimizers(tmp_path):
    # the step guards (guards/step_guards.py) run in both step drivers: declared modes here
    class CallsEval(TwoOptimizers):
        def training_step(self, batch):
            if self.state.step == 2:
                self.model.head.eval()
            return super().training_step(batch)

    with pytest.raises(SaferunError, match=r"step 3: module 'head' \(Linear\) is in eval mode"):
        CallsEval(config(tmp_path)).fit()


class TwoOptimizersNorm(TwoOptimizers):
    """The encoder has a BatchNorm: each training forward updates its running statistics."""

    def build_model(self):
        model = TwoNet()
        model.enc = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU())
        return model


def test_skip_policy_restores_the_buffers_the_skipped_steps_forward_changed(tmp_path):
    cfg = config(tmp_path)
    cfg["guards"] = {"nonfinite": "skip"}
    seen = {}

    class Buffers(saferun.Callback):
        def on_train_step_end(self, view, output):
            seen[view.step] = {k: v.clone() for k, v in t.model.named_buffers()}

    t = TwoOptimizersNorm(cfg, callbacks=[Buffers()])
    t.nan_in, t.nan_at = "enc", 5
    t.fit()
    for k in seen[4]:  # step 5's batch statistics went with its dropped update
        assert torch.equal(seen[4][k], seen[5][k]), k
    assert not torch.equal(seen[5]["enc.1.running_mean"], seen[6]["enc.1.running_mean"])


class Forgets(TwoOptimizers):
    def training_step(self, batch):
        x, y = batch
        self.optimize("head", F.cross_entropy(self.model.head(self.model.enc(x).detach()), y))


class Twice(TwoOptimizers):
    def training_step(self, batch):
        x, y = batch
        for _ in range(2):
            self.optimize("head", F.cross_entropy(self.model.head(self.model.enc(x)), y))


class ReturnsLoss(TwoOptimizers):
    def training_step(self, batch):
        super().training_step(batch)
        return torch.zeros((), requires_grad=True)


class Unknown(TwoOptimizers):
    def training_step(self, batch):
        x, y = batch
        self.optimize("body", F.cross_entropy(self.model.head(self.model.enc(x)), y))


class Tuple(TwoOptimizers):
    def build_optimizer(self, params):
        return tuple(super().build_optimizer(params).values())


class Shared(TwoOptimizers):
    def build_optimizer(self, params):
        return {"all": torch.optim.SGD(self.model.parameters(), lr=0.1),
                "enc": torch.optim.SGD(self.model.enc.parameters(), lr=0.1)}


class Orphan(TwoOptimizers):
    def build_optimizer(self, params):
        return {"head": torch.optim.SGD(self.model.head.parameters(), lr=0.1)}


class Outside(TwoOptimizers):
    def build_optimizer(self, params):
        self.temperature = nn.Parameter(torch.ones(()))
        named = super().build_optimizer(params)
        return {**named, "temp": torch.optim.SGD([self.temperature], lr=0.1)}


class OneOptimizer(ToyTrainer):
    def training_step(self, batch):
        loss = super().training_step(batch)
        self.optimize("main", loss)


@pytest.mark.parametrize("trainer, error, words", [
    (Forgets, SaferunError, "did not call self.optimize(name, loss) for 'enc'"),
    (Twice, SaferunError, "was called twice in one step"),
    (ReturnsLoss, SaferunError, "returns None or a dict of scalars to log, not a loss"),
    (Unknown, SaferunError, "no such optimizer; build_optimizer named 'head', 'enc'"),
    (Tuple, SaferunError, "return a dict {name: optimizer}"),
    (Shared, SaferunError, "is in both 'all' and 'enc'"),
    (Orphan, SaferunError, "enc.0.weight, enc.0.bias are in no optimizer"),
    (Outside, SaferunError, "'temp' holds a parameter of shape () that is not in the model"),
    (OneOptimizer, SaferunError, "this Trainer has one optimizer"),
])
def test_wrong_use_is_refused_with_what_to_do(tmp_path, trainer, error, words):
    with pytest.raises(error) as e:
        trainer(config(tmp_path)).fit()
    assert words in str(e.value)


@pytest.mark.parametrize("setting, words", [
    ({"accumulate": 2}, "trainer.accumulate is 2: .* Raise trainer.batch_size"),
    ({"ema": {"decay": 0.99}}, "trainer.ema is on: .* not supported with several optimizers"),
])
def test_settings_that_cannot_be_right_are_refused_with_the_reason(tmp_path, setting, words):
    with pytest.raises(ConfigError, match=words):
        TwoOptimizers(config(tmp_path, **setting)).setup()


@pytest.mark.parametrize("policy", ["raise", "rollback", "skip"])
def test_the_spike_guard_is_refused_with_several_optimizers(tmp_path, policy):
    # its statistics are of one loss and one gradient norm; every policy is refused, raise and
    # rollback too, which now compare the steps at log points rather than in the update
    cfg = config(tmp_path)
    cfg["guards"] = {"spikes": policy}
    with pytest.raises(ConfigError, match=rf"guards.spikes is {policy}: .* set guards.spikes=off "
                                          rf"\(build_optimizer returned several optimizers\)"):
        TwoOptimizers(cfg).setup()


class Renamed(TwoOptimizers):
    def build_optimizer(self, params):
        named = super().build_optimizer(params)
        return {"classifier": named["head"], "enc": named["enc"]}

    def training_step(self, batch):
        x, y = batch
        h = self.model.enc(x)
        self.optimize("classifier", F.cross_entropy(self.model.head(h.detach()), y))
        self.optimize("enc", F.cross_entropy(self.model.head(h), y))


class Single(TwoOptimizers):
    def build_optimizer(self, params):
        return torch.optim.SGD(params, lr=0.1)

    def training_step(self, batch):
        x, y = batch
        return F.cross_entropy(self.model.head(self.model.enc(x)), y)


def test_resume_restores_every_optimizer_by_name_and_refuses_renamed_ones(tmp_path):
    straight = TwoOptimizers(config(tmp_path / "a"))
    straight.fit()
    first = TwoOptimizers(config(tmp_path / "b", max_steps=6))
    first.fit()
    resumed = TwoOptimizers({**config(tmp_path / "b"), "resume": "auto"})
    resumed.fit()
    a, b = weights(straight), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert str(straight.optimizer.state_dict()) == str(resumed.optimizer.state_dict())
    assert straight.scheduler.state_dict() == resumed.scheduler.state_dict()
    with pytest.raises(CheckpointError, match="named head, enc, this Trainer's classifier, enc"):
        Renamed({**config(tmp_path / "b", max_steps=20), "resume": "auto"}).fit()
    with pytest.raises(CheckpointError, match="holds optimizers head, enc, but this Trainer"):
        Single({**config(tmp_path / "b", max_steps=20), "resume": "auto"}).fit()


def named_hyperparameters(t):
    """Each optimizer's parameter-group settings (all but the parameters), by name."""
    return {name: [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
            for name, opt in t.optimizer.items()}


def test_force_resume_replays_each_schedule_by_its_own_steps(tmp_path):
    # enc's update at step 5 is dropped, so its scheduler stepped 7 times in 8 steps
    new_sched = {"_target_": "torch.optim.lr_scheduler.StepLR", "step_size": 4, "gamma": 0.1}

    def run(path, sched, **more):
        cfg = {**config(path, max_steps=8), "guards": {"nonfinite": "skip"}, **more}
        cfg["sched"] = sched or cfg["sched"]
        t = TwoOptimizers(cfg)
        t.nan_in, t.nan_at = "enc", 5
        t.fit()
        return t

    reference = run(tmp_path / "a", new_sched)  # the new schedule from the start
    run(tmp_path / "b", None)
    resumed = run(tmp_path / "b", new_sched, resume="auto", force_resume=True)
    assert resumed.scheduler.state_dict() == reference.scheduler.state_dict()
    assert named_hyperparameters(resumed) == named_hyperparameters(reference)
    assert resumed.optimizer["enc"].param_groups[0]["lr"] == pytest.approx(1e-3)  # not 1e-4


class WithPlateau(TwoOptimizers):
    """The head's schedule follows validation (ReduceLROnPlateau), the encoder's the steps."""

    def build_datasets(self):
        x, y = make_classification(256)
        return TensorDataset(x, y), TensorDataset(x[:64], y[:64])

    def validation_step(self, batch):
        x, y = batch
        return {"loss": F.cross_entropy(self.model.head(self.model.enc(x)), y)}

    def build_scheduler(self, optimizer):
        if optimizer is self.optimizer["head"]:
            return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
        return super().build_scheduler(optimizer)


def test_force_resume_with_a_plateau_among_several_is_refused_naming_it(tmp_path):
    cfg = config(tmp_path, max_steps=4, sched_metric="val/loss")
    WithPlateau(cfg).fit()
    changed = {**config(tmp_path, max_steps=8, sched_metric="val/loss"), "resume": "auto",
               "force_resume": True}
    changed["sched"] = {**changed["sched"], "gamma": 0.1}
    with pytest.raises(ConfigError, match=r"cannot apply them to a ReduceLROnPlateau schedule "
                       r"\(optimizer 'head'\): its rate depends on the validation history"):
        WithPlateau(changed).fit()


def test_unused_parameters_are_named_per_optimizer_once(tmp_path, caplog):
    class Unused(TwoOptimizers):
        def build_model(self):
            model = TwoNet()
            model.spare = nn.Linear(16, 16)  # in enc's optimizer, never called
            return model

        def build_optimizer(self, params):
            optimizers = super().build_optimizer(params)
            optimizers["enc"].add_param_group({"params": self.model.spare.parameters()})
            return optimizers

    cfg = config(tmp_path, max_steps=25)  # past the guard's window of 20 steps
    cfg["guards"] = {"unused_params": True}
    with caplog.at_level("WARNING", logger="saferun"):
        Unused(cfg).fit()
    said = [r.getMessage() for r in caplog.records if "received no gradient" in r.getMessage()]
    assert said == ["2 parameter(s) of optimizer 'enc' received no gradient from its loss in "
                    "any of the first 20 steps: [spare.weight, spare.bias] (2 in all). Its loss "
                    "does not depend on them; if they are never meant to train, freeze them or "
                    "move them to the optimizer whose loss trains them."], said
