"""BufferSnapshot: what a skipped step must undo in the model's buffers."""

import pytest
import torch
from torch import nn

from saferun.guards.buffers import BufferSnapshot
from saferun.errors import SaferunError


class Counts(nn.Module):
    """A BatchNorm (updated in place) and a buffer replaced by a new tensor in every forward."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen = self.seen + len(x)  # assignment: a new tensor object, not an in-place update
        return self.bn(x)


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_restore_undoes_in_place_updates_and_replaced_buffers_of_several_forwards():
    model = Counts()
    snapshot = BufferSnapshot(model)
    model(torch.randn(8, 4))  # an accepted step
    snapshot.take()
    before, seen = state(model), model.seen
    model(torch.randn(8, 4) * float("nan"))  # a bad step over two micro-batches
    model(torch.randn(3, 4))
    assert torch.isnan(model.bn.running_mean).all() and model.seen is not seen
    snapshot.restore()
    after = state(model)
    assert all(torch.equal(after[k], before[k]) for k in before)  # num_batches_tracked too
    assert model.seen is seen and model.seen.item() == 8
    model(torch.randn(2, 4))  # and the next snapshot follows the replaced buffer
    snapshot.take()
    model(torch.randn(5, 4))
    snapshot.restore()
    assert model.seen.item() == 10


def test_a_buffer_registered_after_the_snapshot_was_set_up_is_refused_on_restore():
    model = Counts()
    snapshot = BufferSnapshot(model)
    snapshot.take()
    model.register_buffer("late", torch.ones(2))
    with pytest.raises(SaferunError, match="registered buffers after training started"):
        snapshot.restore()


def test_a_model_without_buffers_can_be_snapshot_every_step():
    """The skip policy takes a snapshot every step: with no buffers (an MLP, a GAN) the second
    take() raised "Tensor list must have at least one tensor" before the fix."""
    model = nn.Linear(4, 2)
    snapshot = BufferSnapshot(model)
    for _ in range(3):
        snapshot.take()
        snapshot.restore()
    assert list(model.buffers()) == []
