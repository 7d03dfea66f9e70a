"""Guarantee 3: between log points the loop reads nothing from the device."""

import pytest
import torch

from saferun.guards.syncs import HostSyncCounter
from toys import ToyTrainer, toy_config


def run_counted(tmp_path, **kw):
    t = ToyTrainer(toy_config(tmp_path, **kw))
    with HostSyncCounter() as counter:
        t.fit()
    return t, counter


@pytest.mark.parametrize("extra", [
    {},
    {"accumulate": 2, "precision": "bf16", "max_grad_norm": None},
    {"tensorboard": True, "progress_bar": True},
])
def test_syncs_equal_log_points_plus_one_per_validation(tmp_path, extra):
    # 300 steps, a log point every 25 steps (12) and validation every 100 steps (3):
    # each log point reads all its metrics in one sync, each validation in one more.
    t, counter = run_counted(tmp_path, max_steps=300, log_every_n_steps=25,
                             val_every_n_steps=100, **extra)
    assert t.state.step == 300
    assert counter.count == 12 + 3 + 1, counter.sites  # + the final save's check of the state


def test_a_per_step_item_in_user_code_is_counted_with_its_line(tmp_path):
    class Chatty(ToyTrainer):
        def training_step(self, batch):
            loss = super().training_step(batch)
            self.last = loss.item()  # the classic per-step stall
            return loss

    t = Chatty(toy_config(tmp_path, max_steps=40, log_every_n_steps=20))
    with HostSyncCounter() as counter:
        t.fit()
    user_sites = [s for s in counter.sites if s.endswith("test_syncs.py:" + str(
        Chatty.training_step.__code__.co_firstlineno + 2))]
    assert user_sites and counter.sites[user_sites[0]] == 40


def test_counter_sees_reads_of_inference_tensors_and_skips_optimizer_internals():
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.Adam(model.parameters())  # Adam reads its host-side step counters
    with HostSyncCounter() as counter:
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
        assert counter.count == 0
        with torch.inference_mode():
            out = model(torch.randn(2, 4)).sum()
        out.item()
        bool(out > 0)
        torch.stack([out, out]).tolist()
    assert counter.count == 3


def test_a_host_buffer_filled_with_device_values_is_counted_at_each_read(tmp_path):
    # A running sum made by a factory without a device starts on the host, but once the loss
    # is added into it in place (or copied or assigned into it) it holds values from the
    # run's device: each read of it is a sync on a GPU, so it is counted here too.
    class Summing(ToyTrainer):
        def training_step(self, batch):
            loss = super().training_step(batch)
            if self.state.step == 0:
                self.total, self.pair, self.first = torch.zeros(()), torch.zeros(2), torch.zeros(2)
            self.total += loss.detach()
            self.pair.copy_(torch.stack([loss.detach(), self.total]))
            self.first[0] = loss.detach()
            if (self.state.step + 1) % 10 == 0:
                self.read = (torch.stack([self.total, self.pair[1]]) / 10).tolist()
                self.read += self.first.tolist()
                self.total.zero_()
            return loss

    t = Summing(toy_config(tmp_path, max_steps=40, log_every_n_steps=20))
    with HostSyncCounter() as counter:
        t.fit()
    line = Summing.training_step.__code__.co_firstlineno + 8
    user = {s: n for s, n in counter.sites.items() if "test_syncs.py" in s}
    assert user == {f"{__file__}:{line}": 4, f"{__file__}:{line + 1}": 4}, user
