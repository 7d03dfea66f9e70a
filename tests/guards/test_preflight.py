"""Guard 6: DataLoader preflight names what workers could not receive, before they start.

Every claim about worker behaviour here is shown with real worker processes.
"""

import multiprocessing
import random
import sys
import threading
import types

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import saferun
from guard_toys import (Compose, KeySampler, RngDataset, Scale, Shifter, TransformDataset,
                        make_local_function)
from saferun.guards.preflight import (check_batch_on_cpu, check_loader, find_rng_objects,
                               find_unpicklable, start_method)


def lambda_dataset() -> TransformDataset:
    return TransformDataset(transform=Compose([Scale(2.0), lambda x: x + 1]))


def test_lambda_transform_kills_spawn_workers_and_preflight_names_it_first():
    loader = DataLoader(lambda_dataset(), batch_size=4, num_workers=1,
                        multiprocessing_context="spawn")
    report = check_loader(loader)
    assert report.start_method == "spawn" and not report.warnings
    [error] = report.errors
    assert error.startswith(
        "dataset.transform.transforms[1]: a lambda (defined at test_preflight.py:")
    assert "workers started with 'spawn'" in error and "module level" in error
    with pytest.raises(saferun.SaferunError, match=r"transforms\[1\]: a lambda"):
        report.raise_errors()
    # What the user gets without preflight: the worker cannot even be started.
    with pytest.warns(UserWarning, match="pickle"), \
            pytest.raises(AttributeError, match="Can't pickle local object"):
        list(loader)


def test_under_fork_the_same_dataset_runs_and_the_finding_is_a_warning():
    loader = DataLoader(lambda_dataset(), batch_size=4, num_workers=2,
                        multiprocessing_context="fork")
    assert [b.tolist() for b in loader] == [[1.0, 3.0, 5.0, 7.0], [9.0, 11.0, 13.0, 15.0]]
    report = check_loader(loader)
    assert report.start_method == "fork" and not report.errors
    [warning] = report.warnings
    assert warning.startswith("dataset.transform.transforms[1]: a lambda")
    assert "'spawn'" in warning and "'forkserver' (Linux from Python 3.14)" in warning
    report.raise_errors()  # warnings alone do not raise


def test_clean_dataset_passes_and_runs_under_spawn():
    # Picklable in spite of appearances: a bound method of a module-level class, a
    # multiprocessing lock (pickled as a handle when workers are spawned), and a
    # sampler holding a lambda (samplers stay in the main process).
    ctx = multiprocessing.get_context("spawn")
    dataset = TransformDataset(transform=Compose([Shifter(1.0).shift, Scale(2.0)]),
                               extra={"lock": ctx.Lock(), "table": torch.ones(1000)})
    loader = DataLoader(dataset, batch_size=4, num_workers=1, multiprocessing_context=ctx,
                        sampler=KeySampler(8))
    report = check_loader(loader)
    assert report.errors == [] and report.warnings == []
    assert not dataset.extra["table"].is_shared()  # the check left tensors where they were
    assert [b.tolist() for b in loader] == [[2.0, 4.0, 6.0, 8.0], [10.0, 12.0, 14.0, 16.0]]


def test_torch_generator_on_the_dataset_kills_spawn_workers_and_is_an_error():
    dataset = RngDataset(torch.Generator().manual_seed(0))
    loader = DataLoader(dataset, batch_size=4, num_workers=1, multiprocessing_context="spawn",
                        timeout=60)
    [error] = check_loader(loader).errors
    assert error.startswith("dataset.rng: a torch.Generator")
    assert "crash while unpickling" in error and "get_worker_info().seed" in error
    with pytest.raises(RuntimeError, match="exited unexpectedly"):
        list(loader)
    fork_report = check_loader(DataLoader(dataset, num_workers=1, multiprocessing_context="fork"))
    assert not fork_report.errors and "would crash" in fork_report.warnings[0]


def test_numpy_generator_makes_every_fork_worker_repeat_the_same_draws():
    dataset = RngDataset(np.random.default_rng(0), n=4)
    loader = DataLoader(dataset, batch_size=2, num_workers=2, multiprocessing_context="fork")
    first, second = [b.tolist() for b in loader]  # one batch from each worker
    assert first == second  # the pitfall is real
    assert [b.tolist() for b in loader] == [first, second]  # and every epoch repeats it
    [warning] = check_loader(loader).warnings
    assert warning.startswith("dataset.rng: a numpy.random.Generator, which DataLoader workers "
                              "do not reseed; every worker copies it")
    assert "all epochs repeat" in warning
    persistent = DataLoader(dataset, num_workers=1, persistent_workers=True,
                            multiprocessing_context="fork")
    assert "all epochs" not in check_loader(persistent).warnings[0]


def test_every_kind_of_generator_object_is_found_and_the_global_ones_are_not():
    dataset = TransformDataset(extra={
        "aug": [np.random.RandomState(0), random.Random(0)],
        "torch": torch.Generator(),
        "global": [np.random.mtrand._rand, random._inst, torch.default_generator,
                   random.SystemRandom()],
    })
    paths = [(f.path, f.what.split(",")[0]) for f in find_rng_objects(dataset)]
    assert paths == [("dataset.extra['aug'][0]", "a numpy.random.RandomState"),
                     ("dataset.extra['aug'][1]", "a random.Random"),
                     ("dataset.extra['torch']", "a torch.Generator")]


def test_collate_fn_and_worker_init_fn_are_checked_too():
    rng = np.random.default_rng(0)
    loader = DataLoader(TransformDataset(), num_workers=1, multiprocessing_context="spawn",
                        collate_fn=make_local_function(),
                        worker_init_fn=lambda worker_id: rng.random())
    errors = check_loader(loader).errors
    assert errors[0].startswith(
        "collate_fn: a local function 'make_local_function.<locals>.double'")
    assert errors[1].startswith("worker_init_fn: a lambda")
    assert len(errors) == 2


@pytest.mark.parametrize("planted, path, what", [
    (lambda: {"fn": make_local_function()}, "dataset.extra['fn']",
     "a local function 'make_local_function.<locals>.double'"),
    (lambda: [open(__file__)], "dataset.extra[0]", "an open file"),
    (lambda: (threading.Lock(),), "dataset.extra[0]", "a threading lock"),
    (lambda: {"log": np}, "dataset.extra['log']", "the module 'numpy'"),
    (lambda: (i for i in range(3)), "dataset.extra", "a generator object"),
    (lambda: torch.ones(2, requires_grad=True) * 2, "dataset.extra",
     "a tensor that is part of an autograd graph"),
    (lambda: Compose([Scale(1.0), Compose([lambda x: x])]),
     "dataset.extra.transforms[1].transforms[0]", "a lambda"),
    (lambda: {"ok": np.zeros(3), "ops": np.array([abs, lambda x: x], dtype=object)},
     "dataset.extra['ops'].flat[1]", "a lambda"),
])
def test_each_offender_is_named_by_its_path(planted, path, what):
    extra = planted()
    [finding] = find_unpicklable(TransformDataset(extra=extra))
    assert finding.path == path and finding.what.startswith(what), finding
    for obj in extra if isinstance(extra, list) else []:
        obj.close()


def test_all_offenders_are_found_and_cycles_terminate():
    dataset = TransformDataset(transform=lambda x: x,
                               extra={"again": None, "f": make_local_function()})
    dataset.extra["again"] = dataset
    paths = [f.path for f in find_unpicklable(dataset)]
    assert paths == ["dataset.transform", "dataset.extra['f']"]
    assert find_unpicklable(TransformDataset(transform=Scale(2.0))) == []


def test_class_from_an_interactive_main_is_named_before_spawn_would_fail(monkeypatch):
    # In a notebook or `python -c`, __main__ has no file, so spawned workers cannot
    # import classes defined there ("Can't get attribute 'Squares' on <module
    # '__main__' (built-in)>"). Stand in such a session for this process.
    main = types.ModuleType("__main__")
    monkeypatch.setitem(sys.modules, "__main__", main)
    Squares = type("Squares", (TransformDataset,), {"__module__": "__main__"})
    main.Squares = Squares  # so pickle.dumps succeeds, as it does in a notebook
    loader = DataLoader(Squares(), num_workers=1, multiprocessing_context="fork")
    [warning] = check_loader(loader).warnings
    assert warning.startswith("dataset: an instance of class 'Squares', defined in an "
                              "interactive session")
    assert "move the class into a .py module" in warning
    helper = make_local_function()
    helper.__module__, helper.__qualname__ = "__main__", "helper"
    main.helper = helper
    [finding] = find_unpicklable(TransformDataset(transform=helper))
    assert str(finding).startswith("dataset.transform: 'helper', defined in an interactive session")


def test_no_workers_no_checks_and_the_default_start_method_is_not_frozen():
    assert check_loader(DataLoader(lambda_dataset())).start_method is None
    before = multiprocessing.get_start_method(allow_none=True)
    assert start_method(DataLoader(lambda_dataset(), num_workers=1)) == (
        before or multiprocessing.get_all_start_methods()[0])
    assert multiprocessing.get_start_method(allow_none=True) == before


def test_batch_from_a_worker_must_be_on_the_cpu():
    loader = DataLoader(TransformDataset(), batch_size=4, num_workers=1,
                        multiprocessing_context="fork", collate_fn=collate_dict)
    for batch in loader:
        check_batch_on_cpu(batch)  # real worker batches: no complaint
    # A CUDA tensor cannot exist here; any non-CPU device takes the same path.
    batch = {"x": [torch.ones(2), torch.ones(2, device="meta")], "y": torch.ones(2)}
    with pytest.raises(saferun.SaferunError,
                       match=r"batch\['x'\]\[1\] is a tensor on meta, delivered by a DataLoader "
                             r"worker.*Return CPU tensors"):
        check_batch_on_cpu(batch)


def collate_dict(samples):
    return {"x": [torch.stack(samples)], "n": len(samples)}
