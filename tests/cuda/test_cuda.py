"""CUDA paths: pinned memory, non_blocking copies, GradScaler, sync counting. Skipped without a GPU."""

import pytest
import torch
import torch.nn.functional as F

import saferun
from saferun.guards.syncs import HostSyncCounter
from toys import ToyTrainer, toy_config
from helpers import InfGrad

pytestmark = pytest.mark.cuda


class SeesBatches(ToyTrainer):
    def training_step(self, batch):
        x, y = batch
        self.devices.add((x.device.type, y.device.type))
        return F.cross_entropy(self.model(x), y)


def test_batches_arrive_on_the_gpu_from_pinned_memory(tmp_path):
    t = SeesBatches(toy_config(tmp_path, device="cuda", max_steps=4))
    t.devices = set()
    t.setup()
    assert t.train_loader.pin_memory and t._non_blocking
    x, _ = next(iter(t.train_loader))
    assert x.is_pinned()
    t.fit()
    assert t.devices == {("cuda", "cuda")}
    assert next(t.model.parameters()).device.type == "cuda"


def test_train_steps_between_log_points_never_sync(tmp_path):
    t = ToyTrainer(toy_config(tmp_path, device="cuda", precision="bf16"))
    t.setup()
    t.model.train()
    batches = [next(iter(t.train_loader)) for _ in range(3)]
    t.train_step([batches[0]])  # warm-up: lazy CUDA initialisation may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for b in batches:
            t.train_step([b])
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_sync_count_on_cuda_equals_log_points_plus_validations(tmp_path, precision):
    t = ToyTrainer(toy_config(tmp_path, device="cuda", precision=precision, max_steps=300,
                              log_every_n_steps=25, val_every_n_steps=100))
    with HostSyncCounter() as counter:
        t.fit()
    assert counter.count == 12 + 3, counter.sites


def test_fp16_trains_with_a_grad_scaler(tmp_path):
    t = ToyTrainer(toy_config(tmp_path, device="cuda", precision="fp16", max_steps=60,
                              log_every_n_steps=20))
    t.setup()
    assert t.scaler.is_enabled()
    first = t.validate()["val/loss"]
    metrics = t.fit()
    assert metrics["val/loss"] < first
    assert all(torch.isfinite(p).all() for p in t.model.parameters())
    assert t.scaler.get_scale() > 0


def test_fp16_grad_scaler_costs_one_sync_per_step(tmp_path):
    # GradScaler.step reads found_inf with .item() on every step (torch/amp/grad_scaler.py);
    # saferun documents this cost rather than hiding it.
    t = ToyTrainer(toy_config(tmp_path, device="cuda", precision="fp16", max_steps=50,
                              log_every_n_steps=25, val_every_n_steps=50))
    with HostSyncCounter() as counter:
        t.fit()
    assert counter.count == 50 + 2 + 1, counter.sites  # steps + log points + validation


class CudaInWorker(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.ones(8, device="cuda"), torch.tensor(0)


def test_cuda_in_a_forked_worker_is_explained(tmp_path):
    class Planted(ToyTrainer):
        def build_datasets(self):
            return CudaInWorker(), None

    torch.ones(1, device="cuda")  # CUDA initialised in the main process, as in any GPU run
    t = Planted(toy_config(tmp_path, device="cuda", num_workers=1, multiprocessing_context="fork"))
    with pytest.raises(saferun.SaferunError, match="DataLoader worker used CUDA|on cuda"):
        t.fit()


def test_sync_audit_on_cuda_reports_a_per_step_item(tmp_path, caplog):
    import logging

    class Chatty(ToyTrainer):
        def training_step(self, batch):
            loss = super().training_step(batch)
            self.seen = loss.item()
            return loss

    cfg = toy_config(tmp_path, device="cuda", max_steps=6, log_every_n_steps=3)
    cfg["guards"] = {"sync_audit": True}
    with caplog.at_level(logging.WARNING, logger="saferun"):
        Chatty(cfg).fit()
    assert any("self.seen = loss.item()" in r.getMessage() for r in caplog.records)


class PlantedAt(ToyTrainer):
    spike_at, overflow_at, nan_input_at = -1, -1, -1

    def training_step(self, batch):
        step = self.state.step + 1
        x, y = batch
        loss = F.cross_entropy(self.model(x * float("nan") if step == self.nan_input_at else x), y)
        if step == self.overflow_at:
            loss = InfGrad.apply(loss)
        return loss * 1000 if step == self.spike_at else loss


def test_fp16_trains_past_a_step_the_spike_guard_skipped(tmp_path):
    # the step after a skipped one used to raise "unscale_() has already been called"
    cfg = toy_config(tmp_path, device="cuda", precision="fp16", max_steps=36, log_every_n_steps=6)
    cfg["guards"] = {"spikes": "skip", "spike_window": 20, "spike_warmup": 10}
    t = PlantedAt(cfg)
    t.spike_at = 30
    t.fit()
    assert t.state.step == 36
    assert all(torch.isfinite(p).all() for p in t.model.parameters())


def test_fp16_steps_the_grad_scaler_skips_do_not_advance_the_schedule(tmp_path):
    cfg = toy_config(tmp_path, device="cuda", precision="fp16", max_steps=6)
    cfg["sched"] = {"_target_": "torch.optim.lr_scheduler.StepLR", "step_size": 1, "gamma": 0.5}
    t = PlantedAt(cfg)
    t.overflow_at = 3
    t.setup()
    ran = []
    t.optimizer.register_step_post_hook(lambda *_: ran.append(1))
    t.fit()
    assert len(ran) <= 5 and t.scheduler.last_epoch == len(ran)
    assert t.optimizer.param_groups[0]["lr"] == 0.05 * 0.5 ** len(ran)


def test_fp16_skip_keeps_a_nan_batch_out_of_the_batchnorm_statistics(tmp_path):
    cfg = toy_config(tmp_path, device="cuda", precision="fp16", max_steps=8, log_every_n_steps=4)
    cfg["guards"] = {"nonfinite": "skip"}
    t = PlantedAt(cfg)
    t.nan_input_at = 3
    metrics = t.fit()
    assert t.state.step == 8 and metrics["val/loss"] == metrics["val/loss"]  # not NaN
    assert all(torch.isfinite(b.float()).all() for b in t.model.buffers())


class _ZerosOnTheCpu(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(x) + torch.zeros(3)  # the planted bug: no device=, so on the CPU


def test_tensor_created_in_forward_without_device_names_the_module(tmp_path):
    """Issue 16, on a real GPU (the CPU suite plants the same mistake with the meta device)."""
    class Planted(ToyTrainer):
        def build_model(self):
            return torch.nn.Sequential(torch.nn.Linear(8, 8), _ZerosOnTheCpu())

    with pytest.raises(saferun.SaferunError) as info:
        Planted(toy_config(tmp_path, device="cuda", max_steps=2)).fit()
    message = str(info.value)
    assert "different devices" in message and "'1' (_ZerosOnTheCpu)" in message
    assert "torch.zeros(3)" in message and "device=x.device" in message
    assert "batch[0]: float32 (32, 8) cuda:0" in message


def test_fp16_a_save_after_a_step_the_grad_scaler_skipped_goes_ahead(tmp_path):
    # the GradScaler's inf gradients at step 2 are its normal signal, not a non-finite state:
    # the save at step 2 checks the parameters, buffers and optimizer state (finite) only
    from saferun.checkpoint import list_checkpoints, load_checkpoint

    cfg = toy_config(tmp_path, device="cuda", precision="fp16", max_steps=4, save_every_n_steps=2)
    t = PlantedAt(cfg)
    t.overflow_at = 2
    t.fit()
    found = list_checkpoints(tmp_path / "run" / "checkpoints")
    assert [p.name for p in found] == ["step-00000002", "step-00000004"]
    for path in found:
        state = load_checkpoint(path)
        assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())


def test_the_step_split_counts_gpu_time_in_its_phase(tmp_path):
    """perf/forward_backward_ms holds the kernels' time, not only their launch: the timed step
    synchronizes the device at its marks (loop/steptimer.py)."""

    class SlowKernel(ToyTrainer):
        def training_step(self, batch):
            torch.cuda._sleep(100_000_000)  # a kernel spinning 1e8 GPU cycles: over 40 ms
            return super().training_step(batch)

    t = SlowKernel(toy_config(tmp_path, device="cuda", max_steps=8, log_every_n_steps=4))
    final = t.fit()
    assert final["perf/forward_backward_ms"] >= 40.0, final
    others = ("perf/data_wait_ms", "perf/optimizer_ms", "perf/guards_ms")
    assert final["perf/forward_backward_ms"] > sum(final[k] for k in others), final
