"""Values training_step logs beside the loss, when not every step or micro-batch reports the
same keys: each is the mean over the samples (micro-batches) and steps that report it, as in
validation. (Before: under trainer.accumulate a key reported by some micro-batches was divided
by the whole step's samples; a key missing from a window's first step was never logged, and a
first-step key missing later raised a bare KeyError at the log point.)"""

import pytest
import torch
import torch.nn.functional as F

from toys import ToyTrainer, toy_config


class Sometimes(ToyTrainer):
    """`first`: the first column's mean, from the micro-batches with an even number of calls;
    `late`: only at step 2; `early`: only at step 1."""

    n_train = 96

    def __init__(self, cfg):
        super().__init__(cfg)
        self.calls, self.reported = 0, []

    def training_step(self, batch):
        x, y = batch
        out = {"loss": F.cross_entropy(self.model(x), y)}
        if self.calls % 2 == 0:
            out["first"] = x[:, 0].mean()
            self.reported.append(x[:, 0].clone())
        self.calls += 1
        out["early" if self.state.step == 0 else "late"] = torch.tensor(float(self.state.step + 1))
        return out


def fit(tmp_path, accumulate):
    t = Sometimes(toy_config(tmp_path / str(accumulate), batch_size=48 // accumulate,
                             accumulate=accumulate, shuffle=False, max_steps=2,
                             log_every_n_steps=2))
    return t, t.fit()


def test_a_value_some_micro_batches_report_is_their_samples_mean(tmp_path):
    t, metrics = fit(tmp_path, accumulate=3)  # micro-batches of 16; steps report 2 and 1 of 3
    per_step = [torch.cat(t.reported[:2]).mean(), t.reported[2].mean()]  # calls 0, 2 | 4
    assert metrics["train/first"] == pytest.approx(torch.stack(per_step).mean().item(), rel=1e-6)
    assert metrics["train/early"] == 1.0 and metrics["train/late"] == 2.0


def test_a_value_some_steps_report_is_logged_as_their_mean(tmp_path):
    t, metrics = fit(tmp_path, accumulate=1)  # only step 1 (call 0) reports "first"
    assert metrics["train/first"] == pytest.approx(t.reported[0].mean().item(), rel=1e-6)
    assert metrics["train/early"] == 1.0 and metrics["train/late"] == 2.0
