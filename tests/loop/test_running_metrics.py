"""The running train metrics keep each step's loss and gradient norm in one preallocated device
tensor (loop/metrics.py): the means, the bad-step search, the checkpoint's layout and a resume
are those of a tensor kept per step, past the tensor's first capacity too."""

import weakref

import pytest
import torch

from saferun.callbacks import StepOutput
from saferun.loop.metrics import RunningTrainMetrics


def _steps(n, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    losses = (torch.rand(n, generator=g) * 3).to(dtype)
    norms = torch.rand(n, generator=g) * 10
    return list(losses.unbind()), list(norms.unbind())


@pytest.mark.parametrize("steps", [1, 127, 128, 129, 300])  # (the first capacity is 128 rows)
def test_the_means_and_the_kept_values_are_those_of_the_steps(steps):
    losses, norms = _steps(steps)
    running = RunningTrainMetrics()
    for i, (loss, norm) in enumerate(zip(losses, norms)):
        running.add(StepOutput(loss=loss, grad_norm=norm, num_samples=4), (0, [[i]]))
    assert running.steps == running.kept == steps and running.samples == 4 * steps
    # the per-step formula of saferun before the buffer, bit for bit
    assert torch.equal(running.losses, torch.stack(losses).float())
    assert torch.equal(running.grad_norms, torch.stack(norms).float())
    read = running.read()
    assert read["train/loss"] == torch.stack(losses).float().mean().item()
    assert read["train/grad_norm"] == torch.stack(norms).float().mean().item()
    assert running.batches[-1] == (0, [[steps - 1]])


def test_a_step_keeps_none_of_its_output_tensors():
    # (held per step until the log point, they cost the allocator more than the one write)
    running = RunningTrainMetrics()
    loss, norm = torch.tensor(1.5), torch.tensor(0.5)
    refs = weakref.ref(loss), weakref.ref(norm)
    running.add(StepOutput(loss=loss, grad_norm=norm, num_samples=1))
    del loss, norm
    assert [r() for r in refs] == [None, None]
    assert running.values.tolist() == [[1.5, 0.5]]


def test_the_checkpoint_holds_the_kept_steps_as_one_tensor_and_loads_back_exactly():
    losses, norms = _steps(200, dtype=torch.bfloat16)  # (a bf16 loss is kept exactly in float32)
    running = RunningTrainMetrics()
    for loss, norm in zip(losses, norms):
        running.add(StepOutput(loss=loss, grad_norm=norm, num_samples=2), None)
    running.add(StepOutput(loss=losses[0], grad_norm=norms[0], num_samples=2, skipped=True))
    state = running.state_dict()
    # one tensor however many steps are kept (a tensor per step cost ~70 ms per 1000 to save)
    assert sum(isinstance(v, torch.Tensor) for v in state.values()) == 1
    assert state["values"].shape == (200, 2) and state["values"].dtype == torch.float32
    expected = torch.stack([torch.stack(losses).float(), torch.stack(norms)], 1)
    assert torch.equal(state["values"], expected)
    assert state["skipped"] == 1 and state["samples"] == 402
    running.reset()  # the buffer is reused: the state saved must not share it
    running.add(StepOutput(loss=torch.tensor(9.0), grad_norm=torch.tensor(9.0), num_samples=1))
    assert torch.equal(state["values"], expected)

    # saferun's earlier layouts, a tensor per step (float32, or each step's own dtype), load the same
    per_step = {k: v for k, v in state.items() if k != "values"}
    older = {**per_step, "losses": list(expected[:, 0].unbind()), "grad_norms": list(expected[:, 1].unbind())}
    old = {**per_step, "losses": [v.clone() for v in losses], "grad_norms": [v.clone() for v in norms]}
    for saved in (state, older, old):
        resumed = RunningTrainMetrics()
        resumed.load_state_dict(saved)
        assert resumed.kept == 200 and resumed.steps == 201 and resumed.samples == 402
        assert torch.equal(resumed.values, torch.stack([torch.stack(losses).float(),
                                                        torch.stack(norms)], 1))
        resumed.add(StepOutput(loss=torch.tensor(7.0), grad_norm=torch.tensor(8.0), num_samples=2))
        assert resumed.values[-1].tolist() == [7.0, 8.0] and resumed.kept == 201


def test_the_first_bad_step_is_found_past_the_first_capacity():
    losses, norms = _steps(250)
    losses[200] = torch.tensor(float("nan"))
    norms[180] = torch.tensor(float("inf"))
    running = RunningTrainMetrics()
    for loss, norm in zip(losses, norms):
        running.add(StepOutput(loss=loss, grad_norm=norm, num_samples=1))
    assert running.first_bad() == (180, "non-finite", 0)
    assert running.first_bad(check_grads=False) == (200, "non-finite", 0)


def test_a_loss_that_requires_grad_or_plain_numbers_are_kept_too():
    # (a train_step of one's own may return them: StepOutput asks for detached tensors)
    running = RunningTrainMetrics()
    weight = torch.tensor(2.0, requires_grad=True)
    running.add(StepOutput(loss=weight * 1.5, grad_norm=torch.tensor(0.5), num_samples=1))
    running.add(StepOutput(loss=1.25, grad_norm=3, num_samples=1))
    assert running.values.tolist() == [[3.0, 0.5], [1.25, 3.0]]
    assert not running.values.requires_grad


def test_plain_numbers_as_the_first_steps_values_are_kept():
    # (the buffer is made on the first step's device: a number has none, the CPU's is taken)
    running = RunningTrainMetrics()
    running.add(StepOutput(loss=1.25, grad_norm=3, num_samples=1))
    running.add(StepOutput(loss=torch.tensor(0.5), grad_norm=torch.tensor(2.0), num_samples=1))
    assert running.values.tolist() == [[1.25, 3.0], [0.5, 2.0]]
    assert running.read()["train/loss"] == 0.875
