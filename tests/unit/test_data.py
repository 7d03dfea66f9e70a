"""Guarantee 8: batches move to the device whatever their nesting; bad leaves are named."""

import dataclasses
from typing import NamedTuple

import numpy as np
import pytest
import torch

import saferun
from saferun.data import batch_size_of, move_to_device

META = torch.device("meta")  # a real device that every build of torch has


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class Sample:
    image: torch.Tensor
    label: int
    extra: dict


def test_nested_batches_are_moved_and_keep_their_types():
    batch = {"pair": Pair(torch.ones(2), torch.zeros(2)),
             "list": [torch.ones(3), (torch.ones(1), "name")],
             "sample": Sample(torch.ones(4, 2), 3, {"mask": torch.ones(4)}),
             "n": 7, "none": None}
    moved = move_to_device(batch, META)
    assert isinstance(moved["pair"], Pair) and moved["pair"].x.device == META
    assert moved["list"][0].device == META and moved["list"][1][0].device == META
    assert moved["list"][1][1] == "name" and isinstance(moved["list"][1], tuple)
    assert isinstance(moved["sample"], Sample) and moved["sample"].image.device == META
    assert moved["sample"].extra["mask"].device == META and moved["sample"].label == 3
    assert moved["n"] == 7 and moved["none"] is None


def test_a_flat_tuple_or_list_of_tensors_is_moved_and_keeps_its_type():  # the step's shortcut
    for batch in ((torch.ones(2), torch.zeros(2, dtype=torch.long)), [torch.ones(2)]):
        moved = move_to_device(batch, META)
        assert type(moved) is type(batch) and len(moved) == len(batch)
        assert all(t.device == META and t.dtype == b.dtype for t, b in zip(moved, batch))


def test_a_batch_already_on_the_cpu_is_not_moved_and_one_that_is_not_still_is():
    # (on the CPU the step skips the .to() calls, each of which would return the tensor itself)
    cpu = torch.device("cpu")
    x, y = torch.ones(2), torch.zeros(2, dtype=torch.long)
    for batch in ((x, y), [x, y]):
        moved = move_to_device(batch, cpu)
        assert type(moved) is type(batch) and moved[0] is x and moved[1] is y
        # a list is a new one, as on a GPU (training_step may rewrite it: the loader's stays)
        assert (moved is batch) == (type(batch) is tuple)
    with pytest.raises(saferun.SaferunError, match=r"cannot move batch\[1\] .* to cpu"):
        move_to_device([x, torch.ones(2, device=META)], cpu)  # not on the CPU: moved (here refused)

    class Moves(torch.overrides.TorchFunctionMode):  # (saferun's host-sync counter is one)
        def __init__(self):
            super().__init__()
            self.seen = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.seen += func is torch.Tensor.to
            return func(*args, **(kwargs or {}))

    with Moves() as moves:  # a mode that watches the moves sees them
        move_to_device((x, y), cpu)
    assert moves.seen == 2


def test_object_with_its_own_to_is_moved_with_it():
    class Graph:
        def __init__(self, nodes):
            self.nodes = nodes

        def to(self, device, non_blocking=False):
            return Graph(self.nodes.to(device, non_blocking=non_blocking))

    assert move_to_device([Graph(torch.ones(3))], META)[0].nodes.device == META


def test_numpy_leaf_is_named_with_the_fix():
    with pytest.raises(saferun.SaferunError, match=r"batch\['x'\]\[1\] is a numpy.ndarray.*torch.from_numpy"):
        move_to_device({"x": [torch.ones(1), np.ones(3)]}, torch.device("cpu"))


def test_batch_size_is_the_first_dimension_of_the_first_tensor():
    assert batch_size_of((torch.ones(5, 2), torch.ones(5))) == 5
    assert batch_size_of({"ids": [1, 2], "x": torch.ones(3, 1)}) == 3
    assert batch_size_of(Sample(torch.ones(6, 1), 0, {})) == 6


@dataclasses.dataclass
class Derived:
    """A batch whose __post_init__ derives a field and counts its calls; one field not in init."""

    x: torch.Tensor
    mask: torch.Tensor = dataclasses.field(init=False)
    built: int = dataclasses.field(init=False, default=0)

    def __post_init__(self):
        self.mask = self.x > 0
        self.built += 1


def test_dataclass_batch_is_moved_field_by_field_without_rerunning_its_constructor():
    batch = Derived(torch.tensor([1.0, -1.0]))
    batch.mask = torch.tensor([True, True])  # changed after construction: must survive the move
    moved = move_to_device(batch, META)
    assert type(moved) is Derived and moved is not batch
    assert moved.built == 1  # __post_init__ did not run again
    assert moved.x.device == META and moved.mask.device == META  # init=False fields move too
    assert batch.x.device.type == "cpu"  # the original is left as it was
    assert torch.equal(move_to_device(batch, torch.device("cpu")).mask, torch.tensor([True, True]))


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor


def test_frozen_dataclass_batch_is_moved():
    moved = move_to_device(Frozen(torch.ones(2)), META)
    assert type(moved) is Frozen and moved.x.device == META


def test_dict_subclasses_keep_their_type_and_default_factory():
    import collections

    batch = collections.defaultdict(list, {"x": torch.ones(2), "ids": [1, 2]})
    moved = move_to_device(batch, META)
    assert type(moved) is collections.defaultdict and moved.default_factory is list
    assert moved["x"].device == META and moved["ids"] == [1, 2]
    ordered = move_to_device(collections.OrderedDict(b=torch.ones(1), a=torch.ones(1)), META)
    assert type(ordered) is collections.OrderedDict and list(ordered) == ["b", "a"]
    assert ordered["a"].device == META


def shard_indices(n, rank, world_size, epoch, evaluation=False, drop_last=False):
    from torch.utils.data import TensorDataset

    from saferun.data import make_loader, set_loader_epoch

    loader = make_loader(TensorDataset(torch.arange(n)), batch_size=3, shuffle=not evaluation,
                         drop_last=drop_last, num_workers=0, pin_memory=False, seed=4, rank=rank,
                         world_size=world_size, evaluation=evaluation)
    set_loader_epoch(loader, 4, epoch, rank)
    return [i for (batch,) in loader for i in batch.tolist()]


def test_training_shards_are_disjoint_and_reshuffled_every_epoch():
    for epoch in (0, 1):
        shards = [shard_indices(12, r, 2, epoch) for r in (0, 1)]
        assert sorted(shards[0] + shards[1]) == list(range(12))
    assert shard_indices(12, 0, 2, 0) != shard_indices(12, 0, 2, 1)  # set_epoch reached the sampler
    assert shard_indices(12, 0, 2, 1) == shard_indices(12, 0, 2, 1)


def test_validation_shards_hold_every_sample_exactly_once():
    shards = [shard_indices(10, r, 3, 0, evaluation=True) for r in range(3)]
    assert sorted(i for s in shards for i in s) == list(range(10))  # no padding, no repeats


def test_a_long_list_of_numbers_is_copied_without_a_call_per_number():
    # A checkpoint's state goes through move_to_device on its way to the CPU: Python's random
    # state alone is a tuple of 625 ints, which must not cost a Python call each (issue 37).
    import random
    import sys

    state = {"python": random.getstate(), "steps": [1.5, 2.5, None], "t": torch.ones(2)}
    calls = []
    sys.setprofile(lambda frame, event, arg: calls.append(frame.f_code.co_name) if event == "call" else None)
    try:
        moved = move_to_device(state, torch.device("cpu"))
    finally:
        sys.setprofile(None)
    assert moved["python"] == state["python"] and moved["steps"] == state["steps"]
    assert moved["steps"] is not state["steps"]  # a list is rebuilt, as any container
    assert torch.equal(moved["t"], state["t"])
    assert len(calls) < 20, len(calls)
