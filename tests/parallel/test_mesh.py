"""trainer.strategy=mesh (issue 34): the task's parallelize(model, mesh) on a device mesh of
trainer.parallel's shape, here the charlm recipe's tensor-parallel plan, run by the real CLI
under torchrun with gloo on the CPU, with trainer.ema on (its average sharded like the model).
Tensor parallel alone (2 processes) runs by default; the 2-D mesh (4 processes) and the
stop-and-resume cases are marked slow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from saferun import ConfigError
from saferun import distributed
from saferun.parallel.mesh import Layout, apply_plan, check_data

from ema_trajectory import hand_ema
from helpers import free_port

HERE = Path(__file__).parent
TIMEOUT = 600
# the smoke job of the recipe with a small corpus, a clipping that acts at every step (the
# gradient norm is above 1.5 at the start), one log point per step, and a weight average
# whose decay lets each step count
DECAY = 0.9
COMMON = ["recipe=charlm", "debug=fast", "trainer.progress_bar=false", "task.sample_chars=0",
          "data.max_chars=100000", "trainer.max_grad_norm=0.5", "trainer.log_every_n_steps=1",
          "task._target_=mesh_job.CountingCharLM", f"trainer.ema.decay={DECAY}"]
TOLERANCE = 1e-5  # relative, per step: the tensor-parallel sums are taken in another order


def run_job(tmp_path: Path, name: str, *overrides: str, nproc: int = 1,
            check: bool = True) -> tuple[subprocess.CompletedProcess[str], Path]:
    run_dir = tmp_path / name
    launch = [sys.executable, "-m", "saferun", "run"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}", "-m", "saferun", "run"]
    proc = subprocess.run([*launch, *COMMON, *overrides, f"hydra.run.dir={run_dir}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT,
                          env={**os.environ, "OMP_NUM_THREADS": "1",
                               "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])})
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc, run_dir


def curve(run_dir: Path) -> dict[int, dict[str, float]]:
    """metrics.jsonl by step: every logged value but the timings."""
    out: dict[int, dict[str, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        out.setdefault(row["step"], {}).update(
            {k: v for k, v in row.items() if "/" in k and not k.startswith("perf/")})
    return out


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return run_job(tmp_path_factory.mktemp("one"), "run")[1]


@pytest.fixture(scope="module")
def tensor_parallel(tmp_path_factory):
    return run_job(tmp_path_factory.mktemp("tp"), "run", "trainer.strategy=mesh",
                   "trainer.parallel.tp=2", "+task.dump=true", "+task.trajectory=true", nproc=2)[1]


def test_tensor_parallel_equals_one_process_at_every_step(one_process, tensor_parallel):
    """Each rank holds half of every split layer, and the losses, the clipped gradient norm
    (over the whole model: DTensor and replicated parameters), validation (of the weights and
    of their average) and the summed counts (over the data dimension only) equal one
    process's at every step. The average, kept by each rank as its halves of the split layers
    and exported whole (model_ema.pt), is the average of the run's weights computed in one
    process, and one process's average but for the rounding the weights themselves differ by."""
    for rank in (0, 1):
        held = json.loads((tensor_parallel / f"rank{rank}.json").read_text())
        assert held == {"dtensor": True, "local_shape": [3 * 96 // 2, 96]}
    want, got = curve(one_process), curve(tensor_parallel)
    assert sorted(got) == sorted(want) == list(range(1, 11))
    for step, values in want.items():
        assert set(got[step]) == set(values), step
        for key, value in values.items():
            assert got[step][key] == pytest.approx(value, rel=TOLERANCE), (step, key)
    assert got[10]["train/seen"] == 32  # one step's batch, counted once (not once per rank)
    assert "val_ema/loss" in got[10] and got[10]["val_ema/loss"] != got[10]["val/loss"]
    assert_close_weights(tensor_parallel / "model_ema.pt", hand_ema(tensor_parallel, DECAY))
    # the weights differ from one process's by the rounding of the split sums (up to ~3e-6
    # after 10 AdamW steps, on weights of ~0.1): so do their averages, no more
    assert_close_weights(tensor_parallel / "model_ema.pt", one_process / "model_ema.pt", atol=1e-5)


def assert_close_weights(got: Path | dict, want: Path | dict, atol: float = 1e-7) -> None:
    """Two whole state dicts (or the files holding them) equal within TOLERANCE, by name."""
    a, b = (torch.load(w, weights_only=True) if isinstance(w, Path) else w for w in (got, want))
    assert a.keys() == b.keys()
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=TOLERANCE, atol=atol, msg=k)


def test_a_tensor_parallel_run_is_evaluated_from_its_directory_in_one_process(
        tensor_parallel, tmp_path, monkeypatch):
    """from_run builds the model whole (no mesh in one process) with model.pt's weights and
    model_ema.pt's: validation equals the run's last one, of both."""
    monkeypatch.syspath_prepend(str(HERE))
    from mesh_job import CountingCharLM

    trainer = CountingCharLM.from_run(str(tensor_parallel), "last", out_dir=str(tmp_path / "eval"))
    metrics = trainer.validate()
    for key in ("val/loss", "val_ema/loss"):
        assert metrics[key] == pytest.approx(curve(tensor_parallel)[10][key], rel=TOLERANCE)


def test_a_mesh_that_does_not_fit_the_job_is_refused_naming_the_key():
    t = _trainer_config(tp=3)
    with pytest.raises(ConfigError, match=r"trainer.parallel: dp_shard=None x tp=3 must be the number of processes, 4"):
        Layout.of(t, distributed.Ranks(0, 4, 0), torch.device("cpu"))
    with pytest.raises(ConfigError, match="trainer.strategy=mesh .* not launched by torchrun"):
        Layout.of(_trainer_config(tp=2), distributed.Ranks(), torch.device("cpu"))
    assert Layout.of(_trainer_config(tp=2, ema={"decay": 0.9}), distributed.Ranks(0, 2, 0),
                     torch.device("cpu")) == Layout(dp_shard=1, tp=2)  # the average: sharded too
    assert Layout.of(_trainer_config(tp=2), distributed.Ranks(0, 4, 0), torch.device("cpu")) \
        == Layout(dp_shard=2, tp=2)
    with pytest.raises(ConfigError, match="trainer.parallel.tp must be a positive integer"):
        _trainer_config(tp=0)


class Holder:
    """A task whose parallelize returns `out` (None: the model it was given)."""

    def __init__(self, out=None) -> None:
        self.out = out

    def parallelize(self, model, mesh):
        return model if self.out is None else self.out


def test_a_plan_that_replaces_the_model_or_splits_nothing_is_refused():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=r"Holder.parallelize\(model, mesh\) returned Sequential, not "
                                          r"the model it was given: apply the plan in place"):
        apply_plan(Holder(torch.nn.Sequential(model)), model, None, Layout(2, 1))
    with pytest.raises(ConfigError, match=r"trainer.parallel.tp=2, but Holder.parallelize\(model, mesh\) "
                                          r"split no parameter"):
        apply_plan(Holder(), model, None, Layout(1, 2))
    apply_plan(Holder(), model, None, Layout(2, 1))  # no tensor parallel: nothing to split


def test_with_tensor_parallel_a_stream_or_torchmetrics_are_refused_naming_them():
    """Both would go over every rank, not the data dimension: a stream splits itself by
    global rank, torchmetrics syncs each group's state tp times."""
    from torch.utils.data import DataLoader, IterableDataset, TensorDataset

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

    with pytest.raises(ConfigError, match=r"trainer.parallel.tp=2 with a training stream \(Stream"):
        check_data(Layout(1, 2), DataLoader(Stream()), {})
    table = DataLoader(TensorDataset(torch.zeros(4, 1)))
    with pytest.raises(ConfigError, match=r"trainer.parallel.tp=2 with build_metrics\(\) \(acc\)"):
        check_data(Layout(1, 2), table, {"acc": object()})
    check_data(Layout(1, 2), table, {})
    check_data(Layout(2, 1), DataLoader(Stream()), {"acc": object()})  # no tensor parallel


def test_several_optimizers_on_a_mesh_are_refused_naming_the_strategy():
    from saferun.config import load_config
    from saferun.loop.optimizers import check_config

    with pytest.raises(ConfigError, match="trainer.strategy is mesh: each optimize"):
        check_config(load_config({"trainer": {"strategy": "mesh"}}))


def _trainer_config(tp: int, **trainer):
    from saferun.config import load_config

    return load_config({"trainer": {"strategy": "mesh", "parallel": {"tp": tp}, **trainer}}).trainer


@pytest.mark.slow
def test_a_stop_on_one_rank_stops_both_and_the_resume_equals_the_uninterrupted_run_bitwise(
        tensor_parallel, tmp_path):
    """SIGTERM on rank 1 only (the metrics are reduced over the data dimension, a group of
    one here: the vote reaches rank 0 on a collective of its own); both save step 4 and exit;
    the resume continues mid-epoch and ends equal to the uninterrupted run, bit for bit."""
    mesh = ["trainer.strategy=mesh", "trainer.parallel.tp=2", "+task.signal_at=4",
            "+task.on_rank=1"]  # (the same config on resume: step 4 is not run again)
    proc, run_dir = run_job(tmp_path, "run", *mesh, nproc=2, check=False)
    assert proc.returncode != 0 and "step-00000004" in str(sorted((run_dir / "checkpoints").iterdir()))
    run_job(tmp_path, "run", *mesh, "resume=auto", nproc=2)
    assert curve(run_dir)[10] == curve(tensor_parallel)[10]
    for name in ("model.pt", "model_ema.pt"):  # the weights and their average
        resumed, whole = (torch.load(d / name, weights_only=True) for d in (run_dir, tensor_parallel))
        assert resumed.keys() == whole.keys() and all(torch.equal(resumed[k], whole[k]) for k in whole)


MESH_2X2 = ["trainer.strategy=mesh", "trainer.parallel.tp=2"]


@pytest.mark.slow
def test_a_2d_mesh_equals_fsdp_over_the_same_data_ranks_at_every_step(tmp_path):
    """dp_shard=2 x tp=2 (4 processes): FSDP2 over the data dimension of the tensor-parallel
    model equals FSDP2 alone on 2 processes (the same two data ranks, which tests/parallel pins
    equal to DDP) at every step: losses, the clipped norm over the whole mesh, validation (of
    the weights and of their average), the summed counts over the data dimension only; the
    average each rank keeps of its shards, gathered whole, equals the average of the run's
    weights computed in one process, and FSDP's."""
    fsdp = run_job(tmp_path, "fsdp", "trainer.strategy=fsdp", nproc=2)[1]
    mesh = run_job(tmp_path, "mesh", *MESH_2X2, "+task.trajectory=true", nproc=4)[1]
    for rank in range(4):  # qkv: rows split over tp, then over dp_shard
        held = json.loads((mesh / f"rank{rank}.json").read_text())
        assert held == {"dtensor": True, "local_shape": [3 * 96 // 4, 96]}
    want, got = curve(fsdp), curve(mesh)
    assert sorted(got) == sorted(want) == list(range(1, 11))
    for step, values in want.items():
        assert set(got[step]) == set(values), step
        for key, value in values.items():
            assert got[step][key] == pytest.approx(value, rel=TOLERANCE), (step, key)
    assert got[10]["train/seen"] == 2 * 32  # two data ranks' batches, not four
    assert_close_weights(mesh / "model_ema.pt", hand_ema(mesh, DECAY))
    assert_close_weights(mesh / "model_ema.pt", fsdp / "model_ema.pt", atol=1e-5)  # (as above)


@pytest.mark.slow
def test_a_2d_mesh_stopped_on_one_rank_resumes_equal_to_the_uninterrupted_run_bitwise(tmp_path):
    signal = ["+task.signal_at=4", "+task.on_rank=3"]
    whole = run_job(tmp_path, "whole", *MESH_2X2, nproc=4)[1]
    proc, run_dir = run_job(tmp_path, "run", *MESH_2X2, *signal, nproc=4, check=False)
    assert proc.returncode != 0 and (run_dir / "checkpoints" / "step-00000004").is_dir()
    run_job(tmp_path, "run", *MESH_2X2, *signal, "resume=auto", nproc=4)  # (step 4 is done)
    assert curve(run_dir)[10] == curve(whole)[10]
    for name in ("model.pt", "model_ema.pt"):  # the weights and their average
        resumed, want = (torch.load(d / name, weights_only=True) for d in (run_dir, whole))
        assert resumed.keys() == want.keys() and all(torch.equal(resumed[k], want[k]) for k in want)


@pytest.mark.slow
@pytest.mark.parametrize("strategy, before, after", [
    (["trainer.strategy=fsdp"], 4, 2), (["trainer.strategy=fsdp"], 2, 4),
    (MESH_2X2, 4, 2), (MESH_2X2, 2, 4)])
def test_resumed_on_another_number_of_processes_with_weights_and_optimizer_exact(
        tmp_path, strategy, before, after):
    """A checkpoint of N processes resumes on M: DCP reshards the model, optimizer and weight
    average, which are exactly as saved (gathered whole, by name); the data order rule is said
    at resume; the run trains on to its end."""
    same = ["sched.total_steps=8", "+task.dump=true"]  # the schedule of the whole run
    _, run_dir = run_job(tmp_path, "run", *strategy, "trainer.max_steps=5", *same, nproc=before)
    saved = torch.load(run_dir / "end.pt", weights_only=False)
    proc, _ = run_job(tmp_path, "run", *strategy, "trainer.max_steps=8", *same, "resume=auto",
                      nproc=after)
    restored = torch.load(run_dir / "start.pt", weights_only=False)
    assert saved["ema"] and saved["ema"]["n_averaged"] == 5
    _assert_same(saved, restored)
    out = proc.stdout + proc.stderr
    data_before, data_after = (n // 2 if strategy is MESH_2X2 else n for n in (before, after))
    assert (f"written by {before} process(es) with {after} (the data split {data_before} ways, "
            f"now {data_after})") in out and "not bitwise exact" in out
    assert curve(run_dir)[8]["train/loss"] > 0


def _assert_same(a, b) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


def test_a_checkpoint_of_another_data_split_on_as_many_processes_is_resharded_not_misread(
        tensor_parallel, tmp_path):
    """Tensor parallel (2 processes, data split 1 way) resumed as FSDP (2 processes, split 2
    ways): as many processes, but each rank's saved data position and random streams are
    another split's; read by rank they would be silently wrong. It resumes as on another
    number of processes: weights exact, the rule said."""
    proc, run_dir = run_job(tmp_path, "run", "trainer.strategy=fsdp", "trainer.max_steps=12",
                            "sched.total_steps=10", "+task.dump=true",  # (the config as saved)
                            "+task.trajectory=true",
                            f"resume={tensor_parallel / 'checkpoints' / 'step-00000010'}", nproc=2)
    out = proc.stdout + proc.stderr
    assert "written by 2 process(es) with 2 (the data split 1 ways, now 2)" in out
    _assert_same(torch.load(tensor_parallel / "end.pt", weights_only=False),
                 torch.load(run_dir / "start.pt", weights_only=False))
    assert max(curve(run_dir)) == 12  # and trained on
