"""The non-finite sentinel: each policy, tested by planting a NaN."""

import logging
import math

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from saferun.checkpoint import list_checkpoints, load_checkpoint
from saferun.guards.syncs import HostSyncCounter
from saferun.errors import NonFiniteError
from toys import ToyTrainer, make_classification, toy_config, weights


class PoisonedData(Dataset):
    """Sample 42 has a NaN feature: the classic bad record."""

    def __init__(self):
        self.x, self.y = make_classification(256)
        self.x[42, 3] = float("nan")

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Poisoned(ToyTrainer):
    def build_datasets(self):
        return PoisonedData(), None


def test_raise_names_the_step_and_the_samples_with_no_per_step_sync(tmp_path):
    t = Poisoned(toy_config(tmp_path, max_steps=40, log_every_n_steps=5))
    with HostSyncCounter() as counter, pytest.raises(NonFiniteError) as e:
        t.fit()
    message = str(e.value)
    # sample 42 is in some batch of epoch 0; the error names that step and its indices
    window = t.state_dict()["per_rank"][0]["running"]["batches"]  # per step since the log point
    bad_step = next(s for s, where in enumerate(window, start=t.state.step - len(window) + 1)
                    if where and any(42 in b for b in where[1]))
    assert f"at step {bad_step}:" in message and "42" in message and "epoch 0" in message
    assert "guards.anomaly_replay=true" in message and "guards.nonfinite=skip" in message
    log_points = -(-bad_step // 5)  # detection at the first log point at or after the bad step
    # the log reads and the report (2 reads, and 2 more to check the samples' inputs for
    # NaN once the failure is found): a constant, no per-step sync
    assert counter.count <= log_points + 2 + 2


def test_no_checkpoint_is_written_after_a_non_finite_step(tmp_path):
    t = Poisoned(toy_config(tmp_path, max_steps=40, log_every_n_steps=100, save_every_n_steps=2,
                            shuffle=False))  # sample 42 is in step 2 (batches of 32)
    with pytest.raises(NonFiniteError, match="at step 2:"):
        t.fit()
    assert list_checkpoints(tmp_path / "run" / "checkpoints") == []


class BadAt(ToyTrainer):
    """The loss is NaN at the steps in `bad` (1-based)."""

    bad = (7,)

    def training_step(self, batch):
        loss = super().training_step(batch)
        return loss * float("nan") if self.state.step + 1 in self.bad else loss


def assert_same_state(a, b):
    """Parameters and buffers (BatchNorm statistics and batch count included), optimizer state."""
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    assert [k for k in wb if not torch.equal(wa[k], wb[k])] == []
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert all(torch.equal(sa["state"][i][k], sb["state"][i][k]) for i in sb["state"] for k in sb["state"][i])


@pytest.mark.parametrize("accumulate", [1, 3])
def test_skip_leaves_the_model_and_optimizer_exactly_as_before_the_step(tmp_path, accumulate):
    cfg = toy_config(tmp_path, max_steps=7, log_every_n_steps=7, shuffle=False, accumulate=accumulate,
                     batch_size=32 // accumulate)
    cfg["optim"] = {"_target_": "torch.optim.AdamW", "lr": 1e-2}
    cfg["guards"] = {"nonfinite": "skip"}
    skipped = BadAt(cfg)
    metrics = skipped.fit()
    cfg["trainer"]["max_steps"] = 6
    cfg["trainer"]["run_dir"] = str(tmp_path / "six")  # a run of its own
    six = BadAt(cfg)
    six.fit()
    assert metrics["train/skipped_steps"] == 1.0 and skipped.state.step == 7
    assert_same_state(skipped, six)


def test_skip_costs_one_host_read_per_step_and_the_buffer_snapshot_none(tmp_path):
    cfg = toy_config(tmp_path, max_steps=10, log_every_n_steps=5, val_every_n_steps=10)
    cfg["guards"] = {"nonfinite": "skip"}
    with HostSyncCounter() as counter:
        ToyTrainer(cfg).fit()
    # steps, log points, validation, the final save's check of the parameters and optimizer
    assert counter.count == 10 + 2 + 1 + 1, counter.sites


class PoisonedWithValidation(ToyTrainer):
    def build_datasets(self):
        return PoisonedData(), super().build_datasets()[1]


def test_a_skipped_nan_batch_leaves_no_nan_in_the_batchnorm_statistics(tmp_path):
    # The NaN batch's forward ran in train mode: without the restore, running_mean/var are NaN,
    # every validation is NaN and model.pt and the checkpoints hold NaN buffers.
    cfg = toy_config(tmp_path, max_steps=16, log_every_n_steps=4, val_every_n_steps=8,
                     save_every_n_steps=8)
    cfg["guards"] = {"nonfinite": "skip"}
    t = PoisonedWithValidation(cfg)
    metrics = t.fit()
    assert math.isfinite(metrics["val/loss"])
    saved = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert [k for k, v in saved.items() if not torch.isfinite(v.float()).all()] == []
    for path in list_checkpoints(tmp_path / "run" / "checkpoints"):
        model = load_checkpoint(path)["model"]
        assert all(torch.isfinite(v.float()).all() for v in model.values()), path


def test_skip_stops_after_too_many_in_a_row(tmp_path):
    cfg = toy_config(tmp_path, max_steps=20)
    cfg["guards"] = {"nonfinite": "skip", "max_consecutive": 3}
    t = BadAt(cfg)
    t.bad = range(5, 100)
    with pytest.raises(NonFiniteError, match=r"3 steps in a row \(5 to 7\)"):
        t.fit()


class GlitchOnce(PoisonedData):
    """Sample 42 reads as NaN the first time only: a transient fault, what rollback is for."""

    glitched = False

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        if i == 42 and not GlitchOnce.glitched:
            GlitchOnce.glitched = True
            return x, y
        return torch.nan_to_num(x), y


class Glitchy(ToyTrainer):
    def build_datasets(self):
        GlitchOnce.glitched = False
        return GlitchOnce(), None


def test_rollback_restores_the_last_checkpoint_and_goes_on(tmp_path, caplog):
    cfg = toy_config(tmp_path, max_steps=20, log_every_n_steps=5, save_every_n_steps=5,
                     shuffle=False)  # sample 42 is in step 2
    cfg["guards"] = {"nonfinite": "rollback"}
    t = Glitchy(cfg)
    with caplog.at_level(logging.WARNING, logger="saferun"):
        metrics = t.fit()
    assert t.state.step == 20 and all(torch.isfinite(p).all() for p in t.model.parameters())
    rolled = [r.getMessage() for r in caplog.records if "Rolled back" in r.getMessage()]
    assert len(rolled) == 1 and "at step 2:" in rolled[0] and "step-00000000" in rolled[0]
    assert "42" in rolled[0]
    assert metrics["train/loss"] == metrics["train/loss"]  # finite, not NaN


class NanOnceAt16(ToyTrainer):
    """A NaN loss at step 16 (once): with max_epochs=2 of 8 steps, the last step of the run."""

    def training_step(self, batch):
        loss = super().training_step(batch)
        if self.state.step + 1 == 16 and not getattr(self, "poisoned", False):
            self.poisoned = True
            return loss + float("nan")
        return loss


def test_a_rollback_after_the_last_epochs_last_step_says_the_run_ends_there(tmp_path, caplog):
    # max_epochs=2 (8 steps each), log points every 5: the epoch's end (its validation) checks
    # step 16, finds the NaN and rolls back to step 15's checkpoint. The epochs' data has run
    # out, so the run ends at step 15; the warning used to say that training continues with the
    # data after step 16, and nothing said that the run ended before it
    cfg = toy_config(tmp_path, max_steps=None, max_epochs=2, log_every_n_steps=5,
                     save_every_n_steps=5)
    cfg["guards"] = {"nonfinite": "rollback"}
    t = NanOnceAt16(cfg)
    with caplog.at_level(logging.WARNING, logger="saferun"):
        t.fit()
    assert t.poisoned and t.state.step == 15
    said = [r.getMessage() for r in caplog.records]
    rolled = [m for m in said if "Rolled back" in m]
    assert len(rolled) == 1 and "(step 15)" in rolled[0] and "if it has steps left" in rolled[0]
    assert not any("training continues" in m for m in said)
    ends = [m for m in said if m.startswith("The run ends at step 15")]
    assert len(ends) == 1 and "from step 16" in ends[0] and "data had run out" in ends[0], said
    final = list_checkpoints(tmp_path / "run" / "checkpoints")[-1]
    assert load_checkpoint(final)["loop"]["step"] == 15


def test_a_run_that_ends_at_the_checkpoint_it_rolled_back_to_validates_those_weights(tmp_path):
    # The epoch's end validates step 16; that validation finds the NaN and rolls back to step
    # 15 instead. The loop counted the step as validated, so the run ended without validating
    # the weights it ends with: fit() returned step 8's val/loss as the final one (a sweep
    # ranks by it), silently. It must equal a clean run that ends at step 15.
    cfg = toy_config(tmp_path, max_steps=None, max_epochs=2, log_every_n_steps=5,
                     save_every_n_steps=5)
    cfg["guards"] = {"nonfinite": "rollback"}
    t = NanOnceAt16(cfg)
    metrics = t.fit()
    assert t.poisoned and t.state.step == 15
    clean = toy_config(tmp_path / "clean", max_steps=15, max_epochs=2, log_every_n_steps=5,
                       save_every_n_steps=5)
    straight = ToyTrainer(clean)
    reference = straight.fit()
    a, b = weights(t), weights(straight)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    val = {k: v for k, v in metrics.items() if k.startswith("val/")}
    assert val and val == {k: v for k, v in reference.items() if k.startswith("val/")}
    final = list_checkpoints(tmp_path / "run" / "checkpoints")[-1]
    assert load_checkpoint(final)["loop"]["validated_at"] == 15


def test_a_second_fit_after_a_run_ended_before_its_rollback_does_not_say_it_again(tmp_path,
                                                                                 caplog):
    # rolled back from step 16 to step 10 (the newest clean checkpoint), the run ended at 10;
    # a second fit to step 12 rolls back from nothing, yet was told it ended at "the checkpoint
    # it rolled back to from step 16"
    cfg = toy_config(tmp_path, max_steps=None, max_epochs=2, log_every_n_steps=10,
                     save_every_n_steps=10)
    cfg["guards"] = {"nonfinite": "rollback"}
    t = NanOnceAt16(cfg)
    t.fit()
    assert t.state.step == 10
    t.cfg.trainer.max_epochs, t.cfg.trainer.max_steps = 3, 12
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="saferun"):
        t.fit()
    assert t.state.step == 12
    said = [r.getMessage() for r in caplog.records]
    assert not any(m.startswith("The run ends at step") for m in said), said


def test_rollback_without_recovery_gives_up(tmp_path):
    cfg = toy_config(tmp_path, max_steps=40, log_every_n_steps=2)
    cfg["guards"] = {"nonfinite": "rollback", "max_consecutive": 2}
    t = BadAt(cfg)
    t.bad = range(1, 100)  # every step: rollback to the step-0 checkpoint cannot help
    with pytest.raises(NonFiniteError, match="Cannot roll back: 3 rollbacks"):
        t.fit()


class MaskedSqrt(ToyTrainer):
    """Pitfall C51: where(z > 0, sqrt(z), 0) at z == 0 is finite forward, NaN backward."""

    def training_step(self, batch):
        loss = super().training_step(batch)
        if self.state.step + 1 == 6:
            z = self.model.head.weight[0, 0] * 0
            loss = loss + torch.where(z > 0, torch.sqrt(z), torch.zeros_like(z))
        return loss


def test_anomaly_replay_names_the_backward_op_and_its_forward_line(tmp_path):
    cfg = toy_config(tmp_path, max_steps=20, log_every_n_steps=10)
    cfg["guards"] = {"anomaly_replay": True}
    with pytest.raises(NonFiniteError) as e:
        MaskedSqrt(cfg).fit()
    message = str(e.value)
    assert "at step 6:" in message and "SqrtBackward0" in message
    assert "torch.sqrt(z)" in message and "test_nonfinite.py" in message


def test_parameters_can_be_checked_and_their_norm_is_logged(tmp_path):
    cfg = toy_config(tmp_path, max_steps=4, log_every_n_steps=2)
    cfg["guards"] = {"check_params": True}
    metrics = ToyTrainer(cfg).fit()
    assert metrics["train/param_norm"] > 0


def test_unused_parameters_are_named_once(tmp_path, caplog):
    class WithUnused(ToyTrainer):
        def build_model(self):
            model = super().build_model()
            model.aux_head = nn.Linear(16, 2)  # built, never called in forward
            return model

    with caplog.at_level(logging.WARNING, logger="saferun"):
        WithUnused(toy_config(tmp_path, max_steps=6)).fit()
    said = [r.getMessage() for r in caplog.records if "received no gradient" in r.getMessage()]
    assert len(said) == 1 and "aux_head.weight, aux_head.bias" in said[0]


def test_off_lets_nan_through(tmp_path):
    cfg = toy_config(tmp_path, max_steps=10, log_every_n_steps=10)
    cfg["guards"] = {"nonfinite": "off"}
    metrics = BadAt(cfg).fit()
    assert metrics["train/loss"] != metrics["train/loss"]  # NaN, as asked


class GlitchAt(Dataset):
    """Sample `bad` reads as NaN the first time only; records the first feature of each sample
    read, so a test can tell which data a step used."""

    def __init__(self, bad):
        self.x, self.y = make_classification(256)
        self.bad, self.glitched = bad, False

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i].clone()
        if i == self.bad and not self.glitched:
            self.glitched = True
            x[3] = float("nan")
        return x, self.y[i]


class RecordsSteps(ToyTrainer):
    """Records, at every training step, the weights it starts from and its first input."""

    def build_datasets(self):
        return GlitchAt(bad=200), None  # batches of 32, unshuffled: sample 200 is in step 7

    def training_step(self, batch):
        self.entering.append((self.state.step + 1, weights(self), batch[0][0].clone()))
        return super().training_step(batch)


def test_rollback_resumes_from_the_newest_checkpoints_weights_with_the_data_after_the_bad_step(
        tmp_path, caplog):
    cfg = toy_config(tmp_path, max_steps=20, log_every_n_steps=5, save_every_n_steps=5,
                     shuffle=False)
    cfg["guards"] = {"nonfinite": "rollback"}
    t = RecordsSteps(cfg)
    t.entering = []
    with caplog.at_level(logging.WARNING, logger="saferun"):
        t.fit()
    rolled = [r.getMessage() for r in caplog.records if "Rolled back" in r.getMessage()]
    assert len(rolled) == 1 and "at step 7:" in rolled[0] and "step-00000005" in rolled[0]
    steps = [s for s, _, _ in t.entering]
    # steps 1-10 (the NaN at 7 is found at the log point after step 10), then 6-20 again
    assert steps == list(range(1, 11)) + list(range(6, 21)) and t.state.step == 20
    first_pass, after_rollback = t.entering[5], t.entering[10]
    for k, v in first_pass[1].items():  # step 6 starts from the step-5 checkpoint's state again
        assert torch.equal(after_rollback[1][k], v), k
    # and goes on with the data after the bad window: 8 batches an epoch, step 10 used epoch 1's
    # second batch, so the next is epoch 1's third (samples 64-95)
    assert torch.equal(after_rollback[2], t.train_loader.dataset.x[64])
    # the loop's position follows the data: 10 + 15 batches read, 8 an epoch
    assert (t.state.epoch, t.state.batches_in_epoch) == (3, 1)
    assert t.state.samples_seen == 20 * 32  # counted from the checkpoint's, as the steps are
    assert all(torch.isfinite(v).all() for v in weights(t).values())


def test_skip_leaves_the_optimizer_and_the_schedule_one_step_behind(tmp_path):
    from saferun import Callback

    class Skipped(Callback):
        def __init__(self):
            self.steps = []

        def on_train_step_end(self, view, output):
            if output.skipped:  # a Python bool: no host sync
                self.steps.append(view.step)

    cfg = toy_config(tmp_path, max_steps=10, log_every_n_steps=5)
    cfg["optim"] = {"_target_": "torch.optim.AdamW", "lr": 1e-2}
    cfg["sched"] = {"_target_": "torch.optim.lr_scheduler.StepLR", "step_size": 1, "gamma": 0.5}
    cfg["guards"] = {"nonfinite": "skip"}
    seen = Skipped()
    t = BadAt(cfg, callbacks=[seen])
    metrics = t.fit()
    assert seen.steps == [7] and t.state.step == 10
    assert t.scheduler.last_epoch == 9 and t.optimizer.param_groups[0]["lr"] == 1e-2 * 0.5**9
    assert all(int(s["step"]) == 9 for s in t.optimizer.state.values())
    assert metrics["train/loss"] == metrics["train/loss"]  # the window with step 7 logged finite


def test_a_non_finite_step_is_caught_before_validation(tmp_path):
    class CountsValidation(BadAt):
        bad = (3,)
        calls = 0

        def validation_step(self, batch):
            self.calls += 1
            return super().validation_step(batch)

    t = CountsValidation(toy_config(tmp_path, max_steps=20, log_every_n_steps=100,
                                    val_every_n_steps=4))
    with pytest.raises(NonFiniteError, match="at step 3:"):
        t.fit()
    assert t.state.step == 4 and t.calls == 0  # found before validating the bad state


def test_non_finite_parameters_are_named_when_check_params_is_on(tmp_path):
    class CorruptsAParameter(ToyTrainer):
        def build_model(self):
            model = super().build_model()
            model.scale = nn.Parameter(torch.ones(2))  # not used by the loss
            return model

        def training_step(self, batch):
            if self.state.step + 1 == 3:
                with torch.no_grad():
                    self.model.scale[1] = float("inf")  # the loss and gradients stay finite
            return super().training_step(batch)

    cfg = toy_config(tmp_path, max_steps=8, log_every_n_steps=4)
    cfg["guards"] = {"check_params": True}
    with pytest.raises(NonFiniteError, match="parameters are not finite at step 4.*scale"):
        CorruptsAParameter(cfg).fit()
    cfg["guards"] = {"check_params": False}  # off: the log points do not look; a save does
    with pytest.raises(NonFiniteError, match="not finite at step 8, where a checkpoint was due: "
                                             "parameter scale"):
        CorruptsAParameter(cfg).fit()
    assert not (tmp_path / "run" / "model.pt").exists()


def test_a_non_finite_gradient_under_a_finite_loss_is_caught(tmp_path):
    class NanGradient(ToyTrainer):
        """sqrt(p) masked by where() at p == 0: the forward stays finite (the loss never sees
        it), the gradient is NaN (pitfall C51). Without clipping only p itself goes NaN."""

        def build_model(self):
            model = super().build_model()
            model.p = nn.Parameter(torch.zeros(()))
            return model

        def training_step(self, batch):
            p = self.model.p
            return super().training_step(batch) + 0 * torch.where(p > 0, torch.sqrt(p), 0.0)

    with pytest.raises(NonFiniteError, match=r"at step 1: loss [\d.]+, gradient norm nan"):
        NanGradient(toy_config(tmp_path, max_steps=8, log_every_n_steps=4,
                               max_grad_norm=None)).fit()


# ---------------------------------------------------------------- no checkpoint holds a NaN


class OverflowsAt(ToyTrainer):
    """SGD with momentum whose update at step `at` (once) leaves an Inf in a parameter, or in the
    optimizer's momentum: what an overflowing update does while that step's loss and gradients
    are finite, so only the next step's loss shows it."""

    at, where = 4, "parameter"

    def build_optimizer(self, params):
        opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
        done = []

        def overflow(optimizer, *_):
            if self.state.step + 1 == self.at and not done:  # (the step counts after its update)
                done.append(True)
                first = optimizer.param_groups[0]["params"][0]
                target = first if self.where == "parameter" else optimizer.state[first]["momentum_buffer"]
                with torch.no_grad():
                    target.view(-1)[0] = float("inf")

        opt.register_step_post_hook(overflow)
        return opt


def all_checkpoints_finite(run_dir):
    """Every checkpoint's parameters, buffers and optimizer state, each checked."""
    for path in list_checkpoints(run_dir / "checkpoints"):
        state = load_checkpoint(path)
        tensors = [*state["model"].values()] + [v for s in state["optimizer"]["state"].values()
                                                 for v in s.values()]
        assert all(torch.isfinite(t).all() for t in tensors if t.is_floating_point()), path.name
    return True


@pytest.mark.parametrize("where, named", [("parameter", "parameter backbone.0.weight"),
                                          ("optimizer", "optimizer state momentum_buffer of "
                                                        "backbone.0.weight")])
def test_a_save_never_writes_a_non_finite_parameter_or_optimizer_state(tmp_path, where, named):
    # default guards; the step-4 update overflows, a checkpoint is due at step 4, the log point at 5
    t = OverflowsAt(toy_config(tmp_path, max_steps=12, log_every_n_steps=5, save_every_n_steps=2))
    t.where = where
    with pytest.raises(NonFiniteError) as e:
        t.fit()
    said = str(e.value)
    assert f"not finite at step 4, where a checkpoint was due: {named}: 0 NaN and 1 Inf" in said
    assert "Nothing was saved at step 4 (step-00000004" in said
    newest = tmp_path / "run" / "checkpoints" / "step-00000002"
    assert (f"The newest checkpoint, {newest}, was saved before step 4 and checked finite when "
            f"saved") in said and f"resume={newest}" in said
    assert "predates" not in said
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == ["step-00000002"]
    assert not (tmp_path / "run" / "model.pt").exists()
    assert all_checkpoints_finite(tmp_path / "run")


def test_rollback_after_a_refused_save_goes_to_the_newest_clean_checkpoint_and_trains_on(
        tmp_path, caplog):
    cfg = toy_config(tmp_path, max_steps=12, log_every_n_steps=5, save_every_n_steps=2)
    cfg["guards"] = {"nonfinite": "rollback"}
    t = OverflowsAt(cfg)
    with caplog.at_level(logging.WARNING, logger="saferun"):
        t.fit()
    rolled = [r.getMessage() for r in caplog.records if "Rolled back" in r.getMessage()]
    assert len(rolled) == 1 and "not finite at step 4" in rolled[0]
    assert "step-00000002 (step 2), the newest clean checkpoint" in rolled[0]
    assert t.state.step == 12 and all(torch.isfinite(p).all() for p in t.model.parameters())
    assert all_checkpoints_finite(tmp_path / "run")
    assert torch.isfinite(torch.stack([v.float().sum() for v in
                                       torch.load(tmp_path / "run" / "model.pt").values()])).all()


def test_rollback_skips_a_newer_checkpoint_that_holds_non_finite_values(tmp_path, caplog):
    # a checkpoint saved without the check (an earlier saferun, guards.nonfinite=off) is the
    # newest: a rollback passes it, saying so, for the newest clean one
    from saferun.checkpoint import save_checkpoint

    cfg = toy_config(tmp_path, max_steps=4, log_every_n_steps=2, save_every_n_steps=2)
    cfg["guards"] = {"nonfinite": "rollback"}
    ToyTrainer(cfg).fit()
    root = tmp_path / "run" / "checkpoints"
    state = load_checkpoint(root / "step-00000004")
    next(iter(state["model"].values())).view(-1)[0] = float("nan")
    save_checkpoint(root, 4, state)
    cfg = toy_config(tmp_path, max_steps=10, log_every_n_steps=2, save_every_n_steps=2)
    cfg["guards"] = {"nonfinite": "rollback"}
    cfg["resume"] = "auto"
    t = ToyTrainer(cfg)
    with caplog.at_level(logging.WARNING, logger="saferun"):
        t.fit()
    rolled = [r.getMessage() for r in caplog.records if "Rolled back" in r.getMessage()]
    assert len(rolled) == 1 and "step-00000002 (step 2), the newest clean checkpoint; skipped, " \
        "newer but not clean: step-00000004 (not finite: parameter backbone.0.weight" in rolled[0]
    assert t.state.step == 10 and all_checkpoints_finite(tmp_path / "run")  # step 4 saved anew


def test_the_save_check_costs_one_host_read_and_nothing_per_step(tmp_path):
    from saferun.guards.badstep import nonfinite_state

    t = ToyTrainer(toy_config(tmp_path, max_steps=3))
    t.fit()
    with HostSyncCounter() as counter:
        assert nonfinite_state(t.model, t.optimizer) is None
    assert counter.count == 1


def test_the_save_check_names_which_of_several_optimizers_holds_the_non_finite_state(tmp_path):
    import torch.nn.functional as F

    class EncOverflows(ToyTrainer):
        """Two optimizers (the head, the encoder), each stepped by training_step; the encoder's
        AdamW second moment overflows at step 4."""

        def build_model(self):
            return nn.ModuleDict({"enc": nn.Sequential(nn.Linear(8, 16), nn.ReLU()),
                                  "head": nn.Linear(16, 3)})

        def build_optimizer(self, params):
            enc = torch.optim.AdamW(self.model["enc"].parameters(), lr=1e-2)

            def overflow(optimizer, *_):
                if self.state.step + 1 == 4:
                    first = optimizer.param_groups[0]["params"][0]
                    optimizer.state[first]["exp_avg_sq"].view(-1)[0] = float("inf")

            enc.register_step_post_hook(overflow)
            return {"head": torch.optim.SGD(self.model["head"].parameters(), lr=0.1), "enc": enc}

        def training_step(self, batch):
            x, y = batch
            h = self.model["enc"](x)
            self.optimize("head", F.cross_entropy(self.model["head"](h.detach()), y))
            self.optimize("enc", F.cross_entropy(self.model["head"](h), y))
            return {}

    t = EncOverflows(toy_config(tmp_path, max_steps=8, log_every_n_steps=8, save_every_n_steps=2))
    with pytest.raises(NonFiniteError, match="not finite at step 4, where a checkpoint was due: "
                                             "optimizer 'enc' state exp_avg_sq of enc.0.weight"):
        t.fit()
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == ["step-00000002"]



def test_a_final_state_rolled_back_is_not_passed_off_as_the_run_s_end(tmp_path):
    # the last step's update overflows: the final save is refused and a rollback goes back;
    # model.pt is not written and the run says how to train the remaining steps
    cfg = toy_config(tmp_path, max_steps=6, log_every_n_steps=3)  # the final save only
    cfg["guards"] = {"nonfinite": "rollback"}
    t = OverflowsAt(cfg)
    t.at = 6
    with pytest.raises(NonFiniteError, match=r"the run's final state \(step 6\) was not finite, so "
                       r"neither its checkpoint nor model.pt was written.*back to step 0.*resume=auto"):
        t.fit()
    assert not (tmp_path / "run" / "model.pt").exists() and all_checkpoints_finite(tmp_path / "run")
    cfg["resume"] = "auto"
    resumed = ToyTrainer(cfg)
    resumed.fit()  # the remaining steps, from the newest clean checkpoint
    assert resumed.state.step == 6 and (tmp_path / "run" / "model.pt").exists()
