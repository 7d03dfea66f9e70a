"""trainer.strategy=fsdp (FSDP2) with real torchrun, gloo on the CPU: shard files per rank and
1/N of the bytes per rank, the whole model.pt, the weight average kept in shards and exported
whole, one reduce-scatter per unit per optimizer step under accumulation, the ranks'
buffers, damaged shards and unsafe metadata refused; slow: equal to DDP (the weight average
too), SIGKILL + resume bitwise (with the average), a failing rank, submodule calls refused, resume on another
number of processes, async saves.

The default slice is one 2-process torchrun (the module fixture) and in-process checks on what
it wrote; every other torchrun case is marked slow.
"""

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from saferun.checkpoint import list_checkpoints, load_checkpoint
from saferun.checkpoint.sharded import SafeReader
from saferun.checkpoint.store import CheckpointError, load_latest
from saferun.errors import ConfigError
from toys import ToyTrainer, toy_config
from helpers import assert_equal_nested, free_port

JOB = str(Path(__file__).with_name("fsdp_job.py"))
TIMEOUT = 300  # a hang fails the test instead of the suite
STEPS, ACCUMULATE, UNITS = 10, 2, 4  # units: the 3 blocks of fsdp_job.Stack and the root
FROZEN = "blocks.1.norm"
EMA = {"decay": 0.9}  # trainer.ema: each step counts


def torchrun(cfg, plant=None, nproc=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={free_port()}", JOB, json.dumps(cfg), json.dumps(plant or {})]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def job_config(run_dir, strategy="fsdp", **trainer):
    # a frozen module inside a unit: FSDP2 shards it, the optimizer never sees it
    knobs = dict(max_steps=STEPS, batch_size=8, accumulate=ACCUMULATE, save_every_n_steps=5,
                 log_every_n_steps=5, val_every_n_steps=5, frozen_modules=[FROZEN])
    cfg = toy_config(run_dir.parent, **{**knobs, **trainer})
    cfg["trainer"].update(run_dir=str(run_dir), strategy=strategy)
    cfg["optim"] = {"_target_": "torch.optim.AdamW", "lr": 0.01}
    return cfg


def load(run_dir, name):
    return torch.load(run_dir / name, weights_only=True)


def job_output(run_dir, rank):
    return json.loads((run_dir / f"run_rank{rank}.json").read_text())


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("fsdp") / "run"
    proc = torchrun(job_config(run_dir, ema=EMA), {"trajectory": True})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run_dir


def test_each_rank_writes_its_shard_and_holds_half_the_bytes(fsdp_run):
    ckpt = fsdp_run / "checkpoints" / f"step-{STEPS:08d}"
    written = {"__0_0.distcp", "__1_0.distcp", ".metadata", "state.pt"}
    assert set(os.listdir(ckpt)) == written | {"manifest.json"}
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert set(manifest["files"]) == written  # every rank's file, hashed
    state = load_checkpoint(ckpt)  # verifies every hash
    assert state["sharded"]["world_size"] == 2 and "model" not in state
    assert len(state["per_rank"]) == 2  # each rank's RNG states and data position
    counted = [json.loads((fsdp_run / f"bytes_rank{r}.json").read_text()) for r in (0, 1)]
    whole = counted[0]["whole"]
    assert sum(c["params"] for c in counted) == whole  # no parameter held twice
    for c in counted:
        # uneven shards (odd sizes) differ by at most one row of each tensor: within 5%
        assert abs(c["params"] - whole / 2) <= 0.05 * whole
        assert c["optim"] == 2 * c["trainable"] > 0  # AdamW's two moments, sharded likewise


def test_model_pt_is_whole_and_loads_into_the_plain_model(fsdp_run):
    from fsdp_job import Stack

    weights = load(fsdp_run, "model.pt")  # weights_only: plain tensors
    torch.manual_seed(0)  # as saferun seeded before build_model
    plain = Stack()
    initial = {k: v.clone() for k, v in plain.state_dict().items()}
    plain.load_state_dict(weights)  # strict: every parameter and buffer, unsharded
    assert all(type(t) is torch.Tensor for t in weights.values())
    for k in initial:  # the frozen module kept its initial weights; the others trained
        assert torch.equal(weights[k], initial[k]) == k.startswith(FROZEN + "."), k
    # every rank ends with rank 0's buffers (BatchNorm statistics), as under DDP
    for rank in (0, 1):
        buffers = load(fsdp_run, f"buffers_rank{rank}.pt")
        assert buffers.keys() and all(torch.equal(buffers[k], weights[k]) for k in buffers)


def test_the_weight_average_is_kept_in_shards_and_equals_the_average_of_the_weights(fsdp_run):
    """trainer.ema under fsdp: each rank keeps and saves only its shards of the average (DCP
    holds two chunks of each averaged tensor, state.pt none of it); model_ema.pt, gathered
    whole, equals the average of the run's weights after each step computed in one process;
    val_ema/ is the validation of that average (BatchNorm statistics averaged too)."""
    from fsdp_job import Stack
    from ema_trajectory import hand_ema
    from toys import make_classification

    ckpt = fsdp_run / "checkpoints" / f"step-{STEPS:08d}"
    state = load_checkpoint(ckpt)
    assert state["sharded"]["ema"] and "ema" not in state
    stored = SafeReader(str(ckpt)).read_metadata().state_dict_metadata
    assert len(stored["ema.module.inp.weight"].chunks) == 2  # one shard per rank
    assert stored["ema.module.inp.weight"].size == torch.Size([30, 8])
    want, got = hand_ema(fsdp_run, EMA["decay"]), load(fsdp_run, "model_ema.pt")
    assert got.keys() == want.keys() == load(fsdp_run, "model.pt").keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-7, msg=k)
    x, y = make_classification(64, seed=1)  # the validation set
    metrics = job_output(fsdp_run, 0)["metrics"]
    for key, weights in (("val/loss", load(fsdp_run, "model.pt")), ("val_ema/loss", want)):
        model = Stack()
        model.load_state_dict(weights)
        with torch.no_grad():
            loss = torch.nn.functional.cross_entropy(model.eval()(x), y).item()
        assert metrics[key] == pytest.approx(loss, rel=1e-5), key
    assert metrics["val_ema/loss"] != metrics["val/loss"]


def test_accumulation_reduce_scatters_once_per_optimizer_step(fsdp_run):
    # one reduce-scatter per unit after the last micro-batch only, not after each of the two
    for rank in (0, 1):
        assert job_output(fsdp_run, rank)["reduce_scatters"] == STEPS * UNITS
    metrics = job_output(fsdp_run, 0)["metrics"]
    assert metrics["train/grad_norm"] > 0 and "val/loss" in metrics


def test_a_damaged_shard_makes_the_resume_fall_back_to_the_previous_checkpoint(fsdp_run, tmp_path):
    root = tmp_path / "checkpoints"
    shutil.copytree(fsdp_run / "checkpoints", root)
    shard = root / f"step-{STEPS:08d}" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="__1_0.distcp does not match its manifest"):
        load_checkpoint(shard.parent)
    path, state = load_latest(root)
    assert path.name == "step-00000005" and state["loop"]["step"] == 5


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_metadata_that_would_run_code_is_refused(fsdp_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = tmp_path / "step"
    shutil.copytree(fsdp_run / "checkpoints" / f"step-{STEPS:08d}", ckpt)
    (ckpt / ".metadata").write_bytes(pickle.dumps(_RunsCode()))
    with pytest.raises(pickle.UnpicklingError, match="refused to unpickle posix.system"):
        SafeReader(str(ckpt)).read_metadata()
    assert not (tmp_path / "PWNED").exists()
    # the real one loads
    good = SafeReader(str(fsdp_run / "checkpoints" / f"step-{STEPS:08d}")).read_metadata()
    assert "model.head.weight" in good.state_dict_metadata


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_a_strategy_for_several_processes_refuses_one(tmp_path, strategy):
    cfg = toy_config(tmp_path)
    cfg["trainer"]["strategy"] = strategy
    with pytest.raises(ConfigError, match=f"trainer.strategy={strategy} .*torchrun"):
        ToyTrainer(cfg).setup()


@pytest.mark.parametrize("key, value, named", [
    ("compile", True, "compile=true"), ("find_unused_parameters", True, "find_unused_parameters=true"),
    ("fsdp", {"cpu_offload": True}, "fsdp.cpu_offload=true")])
def test_what_fsdp_cannot_do_right_is_refused_naming_the_key(key, value, named):
    from saferun.config import load_config
    from saferun import distributed
    from saferun.parallel import fsdp

    t = load_config({"trainer": {"strategy": "fsdp", key: value}}).trainer
    with pytest.raises(ConfigError, match=f"trainer.{named}"):
        fsdp.check(t, distributed.Ranks(0, 2, 0), torch.device("cpu"))


def test_weights_tied_across_two_units_are_refused_naming_both():
    from fsdp_job import Stack

    from saferun.parallel.fsdp import units

    model = Stack()
    model.blocks[2].fc.weight = model.blocks[0].fc.weight  # tied across two units
    with pytest.raises(ConfigError, match=r"blocks\.2\.fc\.weight is also in unit blocks\.0"):
        units(model, [])
    assert [n for n, _ in units(Stack(), [])] == ["blocks.0", "blocks.1", "blocks.2"]


def test_the_default_units_are_the_blocks_of_a_stack_and_named_units_must_exist():
    from fsdp_job import Stack

    from saferun.parallel.fsdp import units
    from saferun.recipes.charlm import CharTransformer

    assert [n for n, _ in units(CharTransformer(layers=3), [])] == ["blocks.0", "blocks.1", "blocks.2"]
    assert [n for n, _ in units(Stack(), [])] == ["blocks.0", "blocks.1", "blocks.2"]
    assert [n for n, _ in units(Stack(), ["head", "Block"])] == ["blocks.0", "blocks.1",
                                                                 "blocks.2", "head"]
    with pytest.raises(ConfigError, match="trainer.fsdp.shard: 'Blocks' is neither .* Block, "):
        units(Stack(), ["Blocks"])


# ---------------------------------------------------------------------- slow: more torchruns

@pytest.mark.slow
def test_fsdp_equals_ddp_after_ten_steps(fsdp_run, tmp_path):
    run_dir = tmp_path / "ddp"
    proc = torchrun(job_config(run_dir, strategy="ddp", ema=EMA))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("model.pt", "model_ema.pt"):  # the weights and their average (whole under DDP)
        ddp, fsdp = load(run_dir, name), load(fsdp_run, name)
        assert ddp.keys() == fsdp.keys()
        # the same arithmetic but for the order of the gradient reductions (all-reduce against
        # reduce-scatter): float32 rounding, through 10 AdamW steps
        for k in ddp:
            torch.testing.assert_close(fsdp[k], ddp[k], rtol=1e-5, atol=1e-6)
    m_ddp, m_fsdp = job_output(run_dir, 0)["metrics"], job_output(fsdp_run, 0)["metrics"]
    for key in ("train/loss", "train/grad_norm", "val/loss"):  # the global gradient norm
        assert m_fsdp[key] == pytest.approx(m_ddp[key], rel=1e-5)


@pytest.mark.slow
def test_activation_checkpointed_blocks_shard_and_train_exactly_as_without(fsdp_run, tmp_path):
    run_dir = tmp_path / "checkpointed"
    proc = torchrun(job_config(run_dir, activation_checkpointing=["Block"]))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "activation checkpointing: 3 module(s) of Block" in proc.stdout + proc.stderr
    plain, checkpointed = load(fsdp_run, "model.pt"), load(run_dir, "model.pt")
    assert plain.keys() == checkpointed.keys()
    for k in plain:  # the recompute runs between FSDP's unshard and reshard: the same arithmetic
        assert torch.equal(checkpointed[k], plain[k]), k
    for rank in range(2):  # each rank's shards of the optimizer state, and its BatchNorm statistics
        for name in (f"optim_rank{rank}.pt", f"buffers_rank{rank}.pt"):
            assert_equal_nested(load(run_dir, name), load(fsdp_run, name), name)



@pytest.mark.slow
def test_four_processes_shard_in_quarters_and_equal_ddp(tmp_path):
    runs = {}
    for strategy in ("fsdp", "ddp"):
        runs[strategy] = tmp_path / strategy
        proc = torchrun(job_config(runs[strategy], strategy=strategy), nproc=4)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    ckpt = runs["fsdp"] / "checkpoints" / f"step-{STEPS:08d}"
    assert {f"__{r}_0.distcp" for r in range(4)} <= set(os.listdir(ckpt))
    counted = [json.loads((runs["fsdp"] / f"bytes_rank{r}.json").read_text()) for r in range(4)]
    whole = counted[0]["whole"]
    assert sum(c["params"] for c in counted) == whole  # no parameter held twice
    # FSDP2 splits each tensor's rows in ceil(rows/4) chunks: rows 30 -> 8, 8, 8, 6 (the last
    # rank holds less); far from the whole model a replicated copy would hold on each rank
    assert all(0.15 * whole < c["params"] < 0.3 * whole for c in counted)
    ddp, fsdp = load(runs["ddp"], "model.pt"), load(runs["fsdp"], "model.pt")
    assert ddp.keys() == fsdp.keys()
    for k in ddp:
        torch.testing.assert_close(fsdp[k], ddp[k], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_killed_and_resumed_equals_uninterrupted_bitwise(fsdp_run, tmp_path):
    run_dir = tmp_path / "run"
    killed = torchrun(job_config(run_dir, ema=EMA), {"signal_at": 8, "signum": int(signal.SIGKILL),
                                                      "on_rank": 0})
    assert killed.returncode != 0
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step-00000005"]
    cfg = job_config(run_dir, ema=EMA)
    cfg["resume"] = "auto"
    resumed = torchrun(cfg)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    for name in ("model.pt", "model_ema.pt"):  # the weights and their average
        a, b = load(run_dir, name), load(fsdp_run, name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b), name
    for rank in (0, 1):
        for name in (f"optim_rank{rank}.pt", f"buffers_rank{rank}.pt"):
            a, b = load(run_dir, name), load(fsdp_run, name)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b), name


@pytest.mark.slow
def test_bf16_parameters_with_fp32_reduction_and_named_units(tmp_path):
    run_dir = tmp_path / "run"
    cfg = job_config(run_dir)
    cfg["trainer"]["fsdp"] = {"param_dtype": "bf16", "reshard_after_forward": False,
                              "shard": ["Block", "head"]}
    proc = torchrun(cfg, {"batchnorm": False})  # (a BatchNorm's fp32 statistics refuse bf16)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the shards, the optimizer state and the export stay fp32: only the gathered copies are bf16
    weights = load(run_dir, "model.pt")
    assert {t.dtype for t in weights.values()} == {torch.float32}
    assert all(v.dtype == torch.float32 for v in load(run_dir, "optim_rank0.pt").values()
               if v.ndim > 0)
    out = job_output(run_dir, 0)
    assert out["reduce_scatters"] == STEPS * (UNITS + 1)  # the head is a unit of its own
    assert 0 < out["metrics"]["train/loss"] < 10


@pytest.mark.slow
def test_a_stateless_optimizer_resumes_its_scheduled_learning_rate(tmp_path):
    # plain SGD keeps no state: its param_groups (the decayed lr) are saved beside the shards
    def config(run_dir):
        cfg = job_config(run_dir)
        cfg["optim"] = {"_target_": "torch.optim.SGD", "lr": 0.1}
        cfg["sched"] = {"_target_": "torch.optim.lr_scheduler.StepLR", "step_size": 3, "gamma": 0.5}
        return cfg

    assert torchrun(config(tmp_path / "straight")).returncode == 0
    run_dir = tmp_path / "run"
    killed = torchrun(config(run_dir), {"signal_at": 8, "signum": int(signal.SIGKILL), "on_rank": 0})
    assert killed.returncode != 0
    cfg = config(run_dir)
    cfg["resume"] = "auto"
    resumed = torchrun(cfg)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    a, b = load(run_dir, "model.pt"), load(tmp_path / "straight", "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_validation_batches_uneven_over_ranks_are_refused_at_setup(tmp_path):
    # 17 samples in batches of 8: rank 0 gets 9 (2 batches), rank 1 8 (1 batch); its extra
    # forward's all-gather would meet the other rank's metric reduction
    proc = torchrun(job_config(tmp_path / "run"), {"val_samples": 17})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert out.count("the ranks get [2, 1] validation batches") == 2, out[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before any training


@pytest.mark.slow
def test_an_exception_on_rank_1_ends_the_job(tmp_path):
    proc = torchrun(job_config(tmp_path / "run"), {"fail_at": 3, "on_rank": 1})
    assert proc.returncode != 0
    assert "planted failure on rank 1" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_nan_on_one_rank_stops_both_and_rollback_reloads_the_shards(tmp_path):
    proc = torchrun(job_config(tmp_path / "raise"), {"nan_at": 2, "on_rank": 1})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert out.count("non-finite values at step 2 on rank 1: loss nan") == 2, out
    cfg = job_config(tmp_path / "rollback")
    cfg["guards"] = {"nonfinite": "rollback"}
    proc = torchrun(cfg, {"nan_at": 7, "on_rank": 1})  # planted again each time step 7 comes
    out = proc.stdout + proc.stderr
    # both ranks reload the step-5 shards together, each time, until max_consecutive (5)
    assert proc.returncode != 0
    assert out.count("step-00000005 (step 5), the newest clean checkpoint; the run goes on") == 2 * 5, out
    assert out.count("Cannot roll back: 6 rollbacks") == 2, out


@pytest.mark.slow
def test_an_async_checkpoint_is_listed_only_once_every_rank_has_written_it(tmp_path):
    # saved at step 5 in the background; completed at the next log point (step 10): a
    # SIGKILL at step 8 leaves it a temporary directory, which a resume does not use
    run_dir = tmp_path / "run"
    cfg = job_config(run_dir)
    cfg["trainer"]["fsdp"] = {"async_save": True}
    killed = torchrun(cfg, {"signal_at": 8, "signum": int(signal.SIGKILL), "on_rank": 0})
    assert killed.returncode != 0
    assert list_checkpoints(run_dir / "checkpoints") == []
    [tmp] = (run_dir / "checkpoints").glob(".tmp-step-00000005-*")
    assert not (tmp / "manifest.json").exists()


@pytest.mark.slow
def test_sigterm_on_one_rank_stops_both_at_one_step_and_completes_the_async_save(tmp_path):
    run_dir = tmp_path / "run"
    cfg = job_config(run_dir, save_every_n_steps=None)
    cfg["trainer"]["fsdp"] = {"async_save": True}
    proc = torchrun(cfg, {"signal_at": 2, "signum": int(signal.SIGTERM), "on_rank": 1})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    # the signal reached rank 1 in step 2; the ranks agreed at the log point after step 5
    assert out.count("stopped by SIGTERM at step 5") == 2, out
    [path] = list_checkpoints(run_dir / "checkpoints")
    assert path.name == "step-00000005" and load_checkpoint(path)["loop"]["step"] == 5


@pytest.mark.slow
def test_a_training_step_calling_submodules_is_refused(tmp_path):
    proc = torchrun(job_config(tmp_path / "run"), {"submodules": True})
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "step 1: training_step did not call self.model(...)" in out, out


@pytest.mark.slow
def test_resumed_on_three_processes_with_a_warning(fsdp_run, tmp_path):
    run_dir = tmp_path / "run"
    cfg = job_config(run_dir, ema=EMA)  # (the config as saved)
    cfg["resume"] = str(fsdp_run / "checkpoints" / "step-00000005")
    proc = torchrun(cfg, nproc=3)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "written by 2 process(es) with 3" in out and "not bitwise exact" in out
    assert json.loads((run_dir / "run_rank2.json").read_text())["metrics"]["train/loss"] > 0
    from fsdp_job import Stack

    Stack().load_state_dict(load(run_dir, "model.pt"))
    Stack().load_state_dict(load(run_dir, "model_ema.pt"))  # the average, resharded 2 -> 3
    assert load_checkpoint(run_dir / "checkpoints" / f"step-{STEPS:08d}")["sharded"]["world_size"] == 3


@pytest.mark.slow
def test_async_saves_train_the_same_and_complete_every_checkpoint(fsdp_run, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    run_dir = tmp_path / "run"
    cfg = job_config(run_dir, ema=EMA)
    cfg["trainer"]["fsdp"] = {"async_save": True}
    proc = torchrun(cfg)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("model.pt", "model_ema.pt"):  # the weights and their average
        a, b = load(run_dir, name), load(fsdp_run, name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b), name
    names = [p.name for p in list_checkpoints(run_dir / "checkpoints")]
    assert names == ["step-00000005", f"step-{STEPS:08d}"]
    for name in names:
        load_checkpoint(run_dir / "checkpoints" / name)
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
    # the average in the background-written shards is the one of its step, as a synchronous
    # save writes it (staged before training went on)
    for run, out in ((run_dir, tmp_path / "async.pt"), (fsdp_run, tmp_path / "sync.pt")):
        dcp_to_torch_save(run / "checkpoints" / "step-00000005", out)
    written, want = (torch.load(tmp_path / f, weights_only=False)["ema"] for f in ("async.pt", "sync.pt"))
    assert written.keys() == want.keys() and all(torch.equal(written[k], want[k]) for k in want)


@pytest.mark.slow
def test_the_charlm_recipe_runs_sharded_from_the_command_line(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         f"--master_port={free_port()}", "-m", "saferun", "run", "recipe=charlm", "debug=fast",
         "trainer.strategy=fsdp", "trainer.progress_bar=false", "task.sample_chars=20",
         "data.max_chars=100000", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads((run_dir / "summary.json").read_text())["step"] == 10
    assert proc.stdout.count("saferun: charlm sample:\ndef ") == 1  # every rank sampled, one printed
    assert load_checkpoint(run_dir / "checkpoints" / "step-00000010")["sharded"]["world_size"] == 2
    from saferun.recipes.charlm import CharTransformer

    CharTransformer().load_state_dict(load(run_dir, "model.pt"))  # the recipe's default model


@pytest.mark.slow
def test_a_non_finite_shard_on_one_rank_refuses_the_save_on_every_rank_without_a_hang(tmp_path):
    # rank 1's update at step 5 leaves an Inf in its own shard; the save due at step 5 checks
    # each rank's shards and agrees: every rank refuses (none waits in the save's collectives)
    run_dir = tmp_path / "run"
    proc = torchrun(job_config(run_dir), {"overflow_at": 5})
    assert proc.returncode != 0
    said = proc.stdout + proc.stderr
    assert said.count("not finite at step 5, where a checkpoint was due: rank 1: parameter "
                      "inp.weight: 0 NaN and 1 Inf") >= 2, said  # the error on both ranks
    assert "Nothing was saved at step 5" in said
    assert list_checkpoints(run_dir / "checkpoints") == [] and not (run_dir / "model.pt").exists()
