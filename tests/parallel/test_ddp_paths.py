"""Real torchrun (2 processes, gloo on the CPU) against one process over the same global
batch: gradients averaged whatever training_step calls, buffers equal on every rank,
callback decisions taken on one rank agreed by all, iterable datasets split across ranks
and workers, and a bounded collective timeout. Most cases share one launch (ddp_cases.py)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from saferun.checkpoint import list_checkpoints
from saferun.data.seeding import seed_everything
from toys import make_classification
from helpers import free_port
from test_torchrun import TIMEOUT

CASES_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ddp_cases.py")
sys.path.insert(0, os.path.dirname(CASES_PATH))
from ddp_cases import Tower, loss_of  # noqa: E402


def config(run_dir, batch_size, **trainer):
    base = dict(max_steps=8, batch_size=batch_size, shuffle=False, log_every_n_steps=4,
                save_every_n_steps=None, run_dir=str(run_dir), progress_bar=False,
                collective_timeout=60)
    base.update(trainer)
    return {"trainer": base, "logger": {},
            "optim": {"_target_": "torch.optim.SGD", "lr": 0.1, "momentum": 0.9,
                      "weight_decay": 0.1}}


def launch(cases, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         f"--master_port={free_port()}", CASES_PATH, json.dumps(cases)],
        capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc


def results(run_dir):
    return [torch.load(os.path.join(run_dir, f"result_rank{r}.pt"), weights_only=False)
            for r in (0, 1)]


def finished(run_dir):
    """Both ranks' results of a case that must end without an error, at the same step,
    with bitwise equal parameters and buffers."""
    r0, r1 = results(run_dir)
    assert r0["error"] is None and r1["error"] is None, r0["error"] or r1["error"]
    assert r0["step"] == r1["step"]
    assert_same(r0["state"], r1["state"])
    return r0, r1


def reference(path="model", aux=False, steps=8):
    """The plain loop the two ranks must equal: one process, batches of 32 in order (with
    shuffle off, rank r's batch j holds samples 32j + r, 32j + r + 2, ...: the two ranks'
    batches j together), SGD as configured, gradients clipped to norm 1 (the default)."""
    seed_everything(0)  # as the Trainer does before build_model
    model = Tower(aux)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    x, y = make_classification(256)
    for step in range(steps):
        batch = slice(32 * step, 32 * step + 32)
        loss_of(model, path, x[batch], y[batch], step).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model.state_dict()


CASES = {
    # how training_step reaches the model
    "submodules": dict(path="submodules"),
    "submodules_accumulate": dict(path="submodules", batch_size=8, accumulate=2),
    "mixed": dict(path="mixed", aux=True),
    "unused": dict(path="submodules", aux=True, find_unused_parameters=True),
    # DDP's own find_unused_parameters fails on this one (aux is used outside its forward)
    "mixed_unused": dict(path="mixed", aux=True, find_unused_parameters=True),
    "switch": dict(path="switch"),
    # a decision taken on one rank, or by a logger (rank 0 only)
    "stop_rank1": dict(max_steps=12, controls=[dict(rank=1, event="step", at=3, stop=True)]),
    "save_evaluate": dict(max_steps=12, controls=[dict(rank=0, event="step", at=5, save=True),
                                                  dict(rank=1, event="step", at=6,
                                                       evaluate=True)]),
    "logger_stop": dict(max_steps=12, logger_stop_at=8),
    "validation_stop": dict(max_steps=12, val_every_n_steps=6,
                            controls=[dict(rank=1, event="validation", at=6, stop=True)]),
    # iterable datasets
    "stream_raw": dict(stream="raw"),
    "stream_sharded": dict(stream="sharded", num_workers=2, max_steps=100, max_epochs=1),
    "stream_presplit": dict(stream="presplit", max_steps=100, max_epochs=2),
    # trainer.limit_val_batches: the first limit x val_batch_size samples, on any world size
    "limit_val": dict(max_steps=4, val_every_n_steps=4, limit_val_batches=1, val_batch_size=16),
    "limit_val_user_loader": dict(loader="distributed", limit_val_batches=1),
    # DataLoaders built by the user
    "loader_random": dict(loader="random"),
    "loader_distributed": dict(loader="distributed"),
    # evaluation that changes the model on rank 1 only: both ranks must stop
    "impure_rank1": dict(impure_on=1, max_steps=4, val_every_n_steps=4),
    # last, as it leaves the process group unusable: rank 1 waits for a message that never
    # comes while rank 0 waits in the gradient all-reduce (gloo's default wait is 30 min)
    "timeout": dict(block_at=2, collective_timeout=3),
}
CASE_KEYS = ("path", "aux", "controls", "stream", "block_at", "loader", "impure_on")


def case(name, root, **override):
    spec = {**CASES[name], **override}
    kw = {k: spec.pop(k) for k in CASE_KEYS if k in spec}
    stop_at = spec.pop("logger_stop_at", None)
    cfg = config(root / name, spec.pop("batch_size", 16), **spec)
    if stop_at:
        cfg["logger"] = {"stop": {"_target_": "ddp_cases.StopLogger", "at": stop_at}}
    return {"cfg": cfg, **kw}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    root = tmp_path_factory.mktemp("paths")
    proc = launch([case(name, root) for name in CASES], root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return root


def assert_same(a, b, exact=True):
    assert a.keys() == b.keys()
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), k
        else:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("name", ["submodules", "submodules_accumulate", "mixed", "unused",
                                  "mixed_unused"])
def test_every_path_to_the_model_averages_gradients(launched, name):
    r0, _ = finished(launched / name)
    one = reference(CASES[name]["path"], CASES[name].get("aux", False))
    # the running mean of rank 0's inputs cannot be one process's; and with accumulation
    # each rank makes two forwards per step
    skip = {"backbone.2.mean"} | ({"backbone.2.calls"} if "accumulate" in CASES[name] else set())
    keys = set(one) - skip
    assert_same({k: r0["state"][k] for k in keys}, {k: one[k] for k in keys}, exact=False)
    if name == "unused":  # no gradient on any rank: weight decay and momentum leave it alone
        seed_everything(0)
        initial = Tower(aux=True).state_dict()
        assert_same({k: r0["state"][k] for k in ("aux.weight", "aux.bias")},
                    {k: initial[k] for k in ("aux.weight", "aux.bias")})


def test_a_step_that_stops_calling_the_model_is_refused(launched):
    for r in results(launched / "switch"):
        assert r["step"] == 2
        assert "step 3: training_step did not call self.model(...)" in r["error"]


def test_a_stop_on_one_rank_is_agreed_at_the_next_log_point(launched):
    r0, _ = finished(launched / "stop_rank1")
    assert r0["step"] == 4  # asked after step 3 on rank 1; log every 4 steps
    # the differential check: equal to the plain loop run for those 4 steps
    one = reference(steps=4)
    keys = set(one) - {"backbone.2.mean"}
    assert_same({k: r0["state"][k] for k in keys}, {k: one[k] for k in keys}, exact=False)
    assert [p.name for p in list_checkpoints(launched / "stop_rank1" / "checkpoints")] == \
        ["step-00000004"]


def test_save_and_evaluate_asked_on_different_ranks_happen_on_both(launched):
    for r in finished(launched / "save_evaluate"):
        assert r["step"] == 12
        assert r["validated"] == [8, 12] and r["saved"] == [8, 12]
    assert [p.name for p in list_checkpoints(launched / "save_evaluate" / "checkpoints")] == \
        ["step-00000008", "step-00000012"]


def test_a_logger_on_rank_0_stops_every_rank(launched):
    assert [r["step"] for r in finished(launched / "logger_stop")] == [8, 8]


def test_a_stop_after_validation_on_one_rank_stops_both_at_once(launched):
    for r in finished(launched / "validation_stop"):
        assert r["step"] == 6 and r["validated"] == [6]


def test_an_unsplit_iterable_dataset_is_refused(launched):
    for r in results(launched / "stream_raw"):
        assert "IterableDataset" in r["error"] and "ShardedStream" in r["error"]


def test_a_user_loader_that_does_not_split_the_data_is_refused(launched):
    for r in results(launched / "loader_random"):
        assert r["step"] == 0
        assert "RandomSampler, which does not split them between the processes" in r["error"]
        assert "DistributedSampler" in r["error"]


def test_a_user_loader_with_a_distributed_sampler_trains_on_the_global_batch(launched):
    r0, _ = finished(launched / "loader_distributed")
    one = reference()
    keys = set(one) - {"backbone.2.mean"}
    assert_same({k: r0["state"][k] for k in keys}, {k: one[k] for k in keys}, exact=False)


def test_evaluation_that_changes_the_model_on_one_rank_stops_every_rank(launched):
    r0, r1 = results(launched / "impure_rank1")
    assert r0["step"] == r1["step"] == 4
    assert "backbone.2.calls" in r1["error"] and "changed during evaluation" in r1["error"]
    assert "evaluation changed the model" in r0["error"] and "on another rank" in r0["error"]


def test_a_sharded_stream_gives_each_rank_and_worker_its_own_items(launched):
    r0, r1 = finished(launched / "stream_sharded")
    # 250 items, 2 ranks x 2 workers: 62 full rounds of 4; the last 2 items are dropped
    assert sorted(r0["ids"] + r1["ids"]) == list(range(248))
    assert {i % 4 for i in r0["ids"]} == {0, 1} and {i % 4 for i in r1["ids"]} == {2, 3}
    assert r0["step"] == 8  # 62 items per worker: 4 batches, 8 per rank


def test_a_presplit_stream_with_uneven_shards_ends_each_epoch_together(launched):
    r0, r1 = finished(launched / "stream_presplit")
    # rank 0 has 128 items (8 batches), rank 1 96 (6): each epoch ends after 6 steps
    assert r0["step"] == 12
    assert r0["ids"] == list(range(0, 192, 2)) * 2 and r1["ids"] == list(range(1, 192, 2)) * 2


def test_a_stream_ends_each_epoch_on_every_rank_at_once(launched):
    r0, r1 = finished(launched / "stream_presplit")
    assert r0["validated"] == r1["validated"] == [6, 12]  # after each epoch, as map-style data


def test_limit_val_batches_means_the_same_samples_on_two_processes_as_on_one(launched):
    r0, r1 = finished(launched / "limit_val")
    model = Tower()
    model.load_state_dict(reference(steps=4))
    model.eval()
    x, y = make_classification(64, seed=1)
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model(x[:16]), y[:16]).item()
    assert r0["val_metrics"] == r1["val_metrics"]
    assert r0["val_metrics"][-1]["val/loss"] == pytest.approx(expected, rel=1e-5)


def test_limit_val_batches_over_a_loader_saferun_cannot_cut_is_refused(launched):
    errors = [r["error"] for r in results(launched / "limit_val_user_loader")]
    assert all("trainer.limit_val_batches=1 under torchrun with 2 processes" in e
               and "a loader built by build_dataloaders" in e for e in errors), errors


def test_the_collective_timeout_reaches_the_process_group(launched):
    errors = [r["error"] for r in results(launched / "timeout")]
    # the first rank to give up names the timeout; the other may see it leave instead
    assert any("Timed out waiting 3000ms" in e for e in errors), errors


@pytest.mark.slow
def test_the_collective_timeout_reaches_the_command_lines_process_group(tmp_path):
    """The command line starts the process group before the config is composed; the
    Trainer then applies trainer.collective_timeout to it."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         f"--master_port={free_port()}", "-m", "saferun", "run", "task._target_=ddp_cases.Case",
         "+task.block_at=2", "trainer.collective_timeout=3", f"hydra.run.dir={tmp_path / 'run'}",
         "trainer.batch_size=16", "trainer.progress_bar=false"],
        cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1",
             "PYTHONPATH": os.pathsep.join([os.path.dirname(CASES_PATH), os.environ["PYTHONPATH"]])})
    assert proc.returncode != 0
    assert "Timed out waiting 3000ms" in proc.stdout + proc.stderr, proc.stderr[-3000:]
