"""trainer.ema: the average is the EMA of the weights after each optimizer step that ran (not
skipped ones), of floating buffers too, with no host sync; it is validated (val_ema/...),
exported (model_ema.pt) and used by validate() after a resume."""

import pytest
import torch

import saferun
from saferun.errors import ConfigError
from saferun.guards.syncs import HostSyncCounter
from saferun.loop.seeding import seed_everything
from toys import SelfSignalling, ToyTrainer, toy_config


class WeightsAfterEachStep(saferun.Callback):
    """The model's parameters and buffers after every step that was not skipped."""

    def __init__(self, trainer):
        self.trainer, self.states = trainer, []

    def on_train_step_end(self, view, output):
        if not output.skipped:
            self.states.append({k: v.detach().clone() for k, v in self.trainer.model.state_dict().items()})


def ema_config(tmp_path, decay=0.8, **kw):
    cfg = toy_config(tmp_path, max_steps=12, batch_size=32, log_every_n_steps=4,
                     val_every_n_steps=6, **kw)
    cfg["trainer"]["ema"] = {"decay": decay}
    return cfg


def test_the_average_is_the_ema_of_the_weights_after_each_step_that_ran(tmp_path):
    cfg = ema_config(tmp_path)
    cfg["guards"] = {"nonfinite": "skip"}
    trainer = SelfSignalling(cfg, nan_at=5)  # step 5 is skipped: the average must not move
    seed_everything(0)  # as setup does before build_model: the initial weights
    initial = {k: v.clone() for k, v in trainer.build_model().state_dict().items()}
    recorder = WeightsAfterEachStep(trainer)
    trainer._user_callbacks.append(recorder)
    trainer.fit()
    assert len(recorder.states) == 11  # 12 steps, one skipped
    expected = dict(initial)
    for weights in recorder.states:
        for k, v in weights.items():
            if v.is_floating_point():  # parameters and BatchNorm's running statistics
                expected[k] = 0.8 * expected[k] + 0.2 * v
            else:  # num_batches_tracked: copied
                expected[k] = v
    averaged = trainer._ema.module.state_dict()
    assert list(averaged) == list(expected)
    for k in expected:
        torch.testing.assert_close(averaged[k], expected[k], rtol=1e-5, atol=1e-6, msg=k)
    assert int(trainer._ema.averaged.n_averaged) == 11


def test_val_ema_is_the_averaged_weights_validation_and_model_ema_pt_holds_them(tmp_path):
    trainer = ToyTrainer(ema_config(tmp_path))
    metrics = trainer.fit()
    assert {"val/loss", "val/acc", "val_ema/loss", "val_ema/acc"} <= set(metrics)
    assert metrics["val_ema/loss"] != metrics["val/loss"]
    exported = torch.load(tmp_path / "run" / "model_ema.pt", weights_only=True)
    assert all(torch.equal(exported[k], v) for k, v in trainer._ema.module.state_dict().items())
    # the same validation, by a trainer without an average whose model holds model_ema.pt
    plain = ToyTrainer(toy_config(tmp_path / "plain"))
    plain.setup()
    plain.model.load_state_dict(exported)
    again = plain.validate()
    assert again["val/loss"] == pytest.approx(metrics["val_ema/loss"], rel=1e-6)
    assert again["val/acc"] == metrics["val_ema/acc"]
    # validate() on the finished run (resume=<run dir>) reports the checkpoint's average
    cfg = ema_config(tmp_path)
    cfg["resume"] = str(tmp_path / "run")
    resumed = ToyTrainer(cfg).validate()
    assert resumed["val_ema/loss"] == pytest.approx(metrics["val_ema/loss"], rel=1e-6)


def test_save_best_can_watch_the_average(tmp_path):
    class Seen(saferun.Callback):
        values = []

        def on_validation_end(self, view, metrics):
            self.values.append(metrics["val_ema/acc"])

    trainer = ToyTrainer(ema_config(tmp_path, save_best="val_ema/acc", save_best_mode="max"),
                         callbacks=[Seen()])
    trainer.fit()
    assert len(Seen.values) == 2 and trainer._checkpointer.best.value == max(Seen.values)


def test_no_host_sync_per_step(tmp_path):
    # 40 steps: log points at 20 and 40 (one read each), validations at 20 and 40, each two
    # passes (raw and averaged weights, one read each)
    trainer = ToyTrainer(toy_config(tmp_path, max_steps=40, log_every_n_steps=20,
                                    val_every_n_steps=20, ema={"decay": 0.9}))
    with HostSyncCounter() as counter:
        trainer.fit()
    assert counter.count == 2 + 2 * 2 + 1, counter.sites  # + the final save's check of the state


@pytest.mark.parametrize("decay", [0, 1, 1.5, -0.1])
def test_decay_out_of_range_is_refused(tmp_path, decay):
    with pytest.raises(ConfigError, match="trainer.ema.decay"):
        ToyTrainer(toy_config(tmp_path, ema={"decay": decay}))


@pytest.mark.parametrize("fused", [False, True])  # fused: the scaler passes found_inf to step
def test_a_step_the_grad_scaler_drops_does_not_move_the_average(tmp_path, fused):
    from test_precision import OverflowsAt, with_cpu_scaler

    cfg = ema_config(tmp_path, max_grad_norm=None)
    cfg["trainer"]["max_steps"], cfg["optim"]["fused"] = 6, fused
    cfg["guards"] = {"nonfinite": "off"}  # as in fp16: the scaler's inf check is the guard
    trainer = OverflowsAt(cfg)  # step 3: inf gradients, the update dropped
    recorder = WeightsAfterEachStep(trainer)
    trainer._user_callbacks.append(recorder)
    with_cpu_scaler(trainer).fit()
    assert trainer._scaler.get_scale() == 2.0**9  # the scaler saw the overflow
    # the weights after steps 2 and 3 are the same: the average takes them once
    assert all(torch.equal(recorder.states[1][k], recorder.states[2][k])
               for k in recorder.states[1] if k.endswith("weight"))
    assert int(trainer._ema.averaged.n_averaged) == 5
