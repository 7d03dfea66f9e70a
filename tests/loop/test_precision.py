"""The GradScaler's bookkeeping around the loop's skipped steps.

saferun refuses fp16 autocast on the CPU, but a GradScaler's bookkeeping (scale, unscale_,
the inf check, step, update) is the same on every device and torch 2.13 runs an enabled one
on the CPU. These tests give the loop an enabled CPU GradScaler; tests/cuda runs real fp16.
"""

import pytest
import torch

import saferun
from toys import ToyTrainer, toy_config, weights
from helpers import InfGrad, cpu_grad_scaler


def with_cpu_scaler(trainer, init_scale=2.0**10):
    with pytest.raises(saferun.SaferunError, match=r"Trainer.scaler is built by setup\(\)"):
        _ = trainer.scaler  # the scaler is chosen at setup, not yet
    with cpu_grad_scaler(init_scale=init_scale):
        trainer.setup()
    return trainer


class SpikesAt(ToyTrainer):
    """The loss is multiplied by 1000 at step 30 (after the spike detector's warm-up)."""

    def training_step(self, batch):
        loss = super().training_step(batch)
        return loss * 1000 if self.state.step + 1 == 30 else loss


def spike_skip_config(tmp_path, name):
    cfg = toy_config(tmp_path / name, max_steps=36, log_every_n_steps=6, shuffle=False)
    cfg["guards"] = {"spikes": "skip", "spike_window": 20, "spike_warmup": 10}
    return cfg


def test_the_step_after_a_skipped_step_works_under_a_grad_scaler(tmp_path):
    # Before: the skip left the scaler's unscale_ pending; step 31 raised "unscale_() has
    # already been called on this optimizer since the last update()".
    scaled = with_cpu_scaler(SpikesAt(spike_skip_config(tmp_path, "scaled")))
    metrics = scaled.fit()
    plain = SpikesAt(spike_skip_config(tmp_path, "plain"))
    plain.fit()
    assert scaled.state.step == 36 and metrics["train/skipped_steps"] == 1.0
    # scaling by a power of two and unscaling is exact: the same steps, bitwise
    ws, wp = weights(scaled), weights(plain)
    assert all(torch.equal(ws[k], wp[k]) for k in wp)
    assert scaled.scaler.get_scale() == 2.0**10  # finite gradients: no back-off


class OverflowsAt(ToyTrainer):
    overflow = (3,)

    def training_step(self, batch):
        loss = super().training_step(batch)
        return InfGrad.apply(loss) if self.state.step + 1 in self.overflow else loss


class LoggedRates(saferun.Callback):
    def __init__(self):
        self.logged = []

    def on_log(self, view, metrics):
        self.logged.append((view.step, metrics["train/lr"]))


@pytest.mark.parametrize("fused", [False, True])  # fused: the scaler passes found_inf to step
def test_steps_the_grad_scaler_skips_do_not_advance_the_schedule(tmp_path, fused):
    cfg = toy_config(tmp_path, max_steps=6, log_every_n_steps=1)
    cfg["optim"]["fused"] = fused
    cfg["sched"] = {"_target_": "torch.optim.lr_scheduler.StepLR", "step_size": 1, "gamma": 0.5}
    cfg["guards"] = {"nonfinite": "off"}  # as in fp16: the scaler's inf check is the guard
    rates = LoggedRates()
    t = with_cpu_scaler(OverflowsAt(cfg, callbacks=[rates]))
    t.fit()
    assert t.scaler.get_scale() == 2.0**9  # step 3 overflowed: the scaler skipped and backed off
    assert t.scheduler.last_epoch == 5  # 6 steps, 5 optimizer steps
    assert t.optimizer.param_groups[0]["lr"] == 0.05 * 0.5**5
    # the rate each step used: step 3 did not step, so steps 3 and 4 used the same rate
    assert rates.logged == [(1, 0.05), (2, 0.025), (3, 0.0125), (4, 0.0125), (5, 0.00625),
                      (6, 0.003125)]
