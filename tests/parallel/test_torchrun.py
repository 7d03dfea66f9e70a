"""Real torchrun, gloo on the CPU: agreement across ranks, equality with one process,
exact resume, failures and signals on one rank, two nodes on localhost, the CLI."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from saferun.checkpoint import list_checkpoints, load_checkpoint
from toys import METRICS, TOYS_PATH, SelfSignalling, toy_config, weights
from helpers import free_port

TIMEOUT = 240  # a hang fails the test instead of the suite


def torchrun(cfg, plant=None, nproc=2, extra=(), env=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={free_port()}", *extra, TOYS_PATH, json.dumps(cfg), json.dumps(plant or {})]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def plain_config(run_dir, batch_size, **kw):
    cfg = toy_config(run_dir.parent, max_steps=8, batch_size=batch_size, shuffle=False,
                     log_every_n_steps=4, **kw)
    cfg["trainer"]["run_dir"] = str(run_dir)
    cfg["optim"] = {"_target_": "torch.optim.SGD", "lr": 0.1, "momentum": 0.9}
    return cfg


def rank_weights(run_dir, rank):
    return torch.load(run_dir / f"final_weights_rank{rank}.pt", weights_only=True)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ddp") / "run"
    # with a weight average and stateful metrics, over 61 validation samples (shards of 31, 30)
    proc = torchrun(averaging_config(run_dir, batch_size=16, tensorboard=True),
                    {"plain": True, "val_size": 61})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run_dir


def averaging_config(run_dir, batch_size, **kw):
    cfg = plain_config(run_dir, batch_size, ema={"decay": 0.5}, **kw)
    cfg["metrics"] = METRICS
    return cfg


def test_ranks_agree_and_equal_one_process_over_the_same_global_batch(two_ranks, tmp_path):
    r0, r1 = rank_weights(two_ranks, 0), rank_weights(two_ranks, 1)
    assert all(torch.equal(r0[k], r1[k]) for k in r0)
    # one process, batches of 32: with shuffle off, rank r's batch j holds samples
    # 32j + r, 32j + r + 2, ...: together the single process's batch j
    single = SelfSignalling(plain_config(tmp_path / "one", batch_size=32), plain=True)
    single.fit()
    one = weights(single)
    for k in one:
        torch.testing.assert_close(r0[k], one[k], rtol=1e-5, atol=1e-6)
    # only rank 0 wrote the event files, the checkpoints and the weights
    assert sorted(p.suffix == ".hparams" for p in (two_ranks / "tensorboard").iterdir()) == [
        False, True]
    assert [p.name for p in list_checkpoints(two_ranks / "checkpoints")] == ["step-00000008"]
    assert (two_ranks / "model.pt").is_file()


def test_metrics_and_weight_average_agree_across_ranks_and_with_one_process(two_ranks, tmp_path):
    """torchmetrics gathers both ranks' unpadded shards: val/f1 and val/auroc are sklearn's over
    the whole validation set; every rank holds the same average, the one-process one."""
    from sklearn.metrics import f1_score, roc_auc_score

    metrics = [{k: v for k, v in json.loads((two_ranks / f"final_metrics_rank{r}.json").read_text())
                .items() if not k.startswith("perf/")} for r in (0, 1)]  # timings differ
    assert metrics[0] == metrics[1]
    ema = [torch.load(two_ranks / f"final_ema_rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert all(torch.equal(ema[0][k], ema[1][k]) for k in ema[0])
    single = SelfSignalling(averaging_config(tmp_path / "one", batch_size=32), plain=True,
                            val_size=61)
    single.fit()
    for k, v in single.ema.state_dict().items():
        torch.testing.assert_close(ema[0][k], v, rtol=1e-5, atol=1e-6)
    x, y = single.val_loader.dataset.tensors
    for prefix, state in (("val", rank_weights(two_ranks, 0)),
                          ("val_ema", {k[len("module."):]: v for k, v in ema[0].items()
                                       if k.startswith("module.")})):
        single.model.load_state_dict(state)
        with torch.no_grad():
            probs = single.model(x).softmax(dim=1)
        assert metrics[0][f"{prefix}/f1"] == pytest.approx(
            f1_score(y, probs.argmax(dim=1), average="macro"), rel=1e-5)
        assert metrics[0][f"{prefix}/auroc"] == pytest.approx(
            roc_auc_score(y, probs, multi_class="ovr", average="macro"), rel=1e-5)


@pytest.mark.slow  # 8 s; the one-node torchrun tests in this file cover the same step
def test_two_nodes_on_localhost(two_ranks, tmp_path):
    run_dir = tmp_path / "run"
    cfg = plain_config(run_dir, batch_size=16)
    port = free_port()
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
         "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}", TOYS_PATH,
         json.dumps(cfg), json.dumps({"plain": True})],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"}) for node in (0, 1)]
    outputs = [n.communicate(timeout=TIMEOUT)[0] for n in nodes]
    assert all(n.returncode == 0 for n in nodes), outputs
    single_node = rank_weights(two_ranks, 0)
    for rank in (0, 1):
        w = rank_weights(run_dir, rank)
        assert all(torch.equal(w[k], single_node[k]) for k in w)


def augmented_config(run_dir):
    cfg = toy_config(run_dir.parent, max_steps=12, batch_size=16, save_every_n_steps=5,
                     log_every_n_steps=3, val_every_n_steps=6)
    cfg["trainer"]["run_dir"] = str(run_dir)
    return cfg


def with_spike_statistics(cfg):
    cfg["guards"] = {"spikes": "raise"}  # warm-up 20: nothing is flagged, every rank keeps stats
    return cfg


def test_killed_and_resumed_equals_uninterrupted(tmp_path):
    straight = tmp_path / "straight"
    assert torchrun(with_spike_statistics(augmented_config(straight))).returncode == 0
    run_dir = tmp_path / "run"
    killed = torchrun(with_spike_statistics(augmented_config(run_dir)),
                      {"signal_at": 8, "signum": int(signal.SIGKILL), "on_rank": 0})
    assert killed.returncode != 0
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step-00000005"]
    cfg = with_spike_statistics(augmented_config(run_dir))
    cfg["resume"] = "auto"
    resumed = torchrun(cfg)
    assert resumed.returncode == 0, resumed.stderr
    for rank in (0, 1):
        a, b = rank_weights(run_dir, rank), rank_weights(straight, rank)
        assert all(torch.equal(a[k], b[k]) for k in a), rank
        # each rank resumed its own spike statistics (its own losses), not rank 0's
        a, b = (load_checkpoint(list_checkpoints(d / "checkpoints")[-1])["per_rank"][rank]["spikes"]
                for d in (run_dir, straight))
        assert set(a) == set(b) == {"loss", "grad_norm"}
        for key in b:  # NaN marks the window's empty slots
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, equal_nan=True)


@pytest.mark.slow  # two torchrun runs; the dropped-state rule's default test: tests/checkpoint
def test_a_resume_with_the_same_loggers_says_nothing_of_dropped_callback_states(tmp_path):
    # the loggers run on rank 0 only, so rank 1 found their saved states (MetricsJsonl,
    # TensorBoardLogger) unclaimed and warned at every resume that they were dropped, telling
    # the user to resume with the callbacks they had resumed with
    run_dir = tmp_path / "run"
    cfg = plain_config(run_dir, batch_size=16, tensorboard=True)
    cfg["logger"] = {**cfg["logger"], "jsonl": {}}
    cfg["trainer"]["max_steps"] = 4
    assert torchrun(cfg).returncode == 0
    cfg["trainer"]["max_steps"], cfg["resume"] = 6, "auto"
    resumed = torchrun(cfg)
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out
    assert "step-00000004: step 4, epoch" in out, out  # resumed (from the first run's last)
    assert "does not have" not in out, out


def test_sigterm_on_one_rank_stops_all_ranks_at_the_same_step(tmp_path):
    run_dir = tmp_path / "run"
    proc = torchrun(augmented_config(run_dir), {"signal_at": 4, "signum": int(signal.SIGTERM),
                                                "on_rank": 1})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    # the signal reached rank 1 during step 4; the ranks agreed at the log point after step 6
    assert out.count("stopped by SIGTERM at step 6") == 2, out
    assert list_checkpoints(run_dir / "checkpoints")[-1].name == "step-00000006"
    assert "exitcode  : 143" in out


def test_a_nan_on_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    proc = torchrun(augmented_config(tmp_path / "run"), {"nan_at": 2, "on_rank": 1})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    # the gradients, averaged, are NaN on both ranks; the report names where the NaN started
    assert out.count("non-finite values at step 2 on rank 1: loss nan") == 2, out


def test_an_unfreeze_on_one_rank_ends_every_rank_with_its_reason(tmp_path):
    # rank 1 alone makes the frozen first layer trainable at step 3: its log point (step 4)
    # refuses it, and the job ends: rank 0, left in the log point's collective, says that
    # another rank failed first instead of waiting (TIMEOUT turns a hang into a failure)
    cfg = plain_config(tmp_path / "run", batch_size=16, frozen_modules=["0"])
    proc = torchrun(cfg, {"plain": True, "unfreeze_at": 3, "on_rank": 1})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "[rank1]: saferun.errors.SaferunError: step 4: parameters became trainable after " \
           "training started: [0.weight, 0.bias]" in out, out
    assert "rank 0 stopped after step 4: a collective with the other ranks failed" in out, out
    assert not list((tmp_path / "run").glob("final_weights_rank*.pt"))  # neither rank finished


def spike_config(run_dir, max_steps):
    cfg = plain_config(run_dir, batch_size=16, save_every_n_steps=10)
    cfg["trainer"]["max_steps"] = max_steps
    cfg["guards"] = {"spikes": "raise", "spike_window": 8, "spike_warmup": 4}
    return cfg


def test_a_spike_on_rank_1_is_reported_with_its_values_and_checkpointed_per_rank(tmp_path):
    run_dir = tmp_path / "run"
    proc = torchrun(spike_config(run_dir, 16), {"plain": True, "spike_at": 12, "on_rank": 1})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    # both ranks raise the same report: rank 1's loss (1000x) and rank 1's samples (shuffle off:
    # rank r holds samples r, r + 2, ...), not rank 0's
    reports = re.findall(r"loss spike or gradient explosion .*at step 12 on rank 1: loss ([\d.]+), "
                         r"gradient norm [\d.]+; epoch 1, sample indices \[([\d, .]+)\]", out)
    assert len(reports) == 2, out
    for loss, indices in reports:
        assert float(loss) > 100
        assert all(int(i) % 2 == 1 for i in indices.replace("...", "").split(",") if i.strip())
    # the step-10 checkpoint holds each rank's own detector state (their losses differ); that
    # each rank resumes its own is tested by test_killed_and_resumed_equals_uninterrupted
    saved = load_checkpoint(run_dir / "checkpoints" / "step-00000010")["per_rank"]
    r0, r1 = saved[0]["spikes"]["loss"], saved[1]["spikes"]["loss"]
    assert int(r0["count"]) == int(r1["count"]) == 10 and not torch.equal(r0["values"], r1["values"])


def test_the_command_line_under_torchrun_uses_one_run_directory(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         f"--master_port={free_port()}", "-m", "saferun", "run", "debug=fast",
         "trainer.progress_bar=false"],
        cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = list((tmp_path / "runs" / "digits").iterdir())
    assert len(runs) == 1
    assert {p.name for p in runs[0].iterdir()} >= {"config.yaml", "summary.json", "model.pt",
                                                   "tensorboard", "checkpoints"}
    assert json.loads((runs[0] / "summary.json").read_text())["step"] == 10
    assert proc.stdout.count("saferun: done at step 10") == 1  # rank 0 speaks for the job


SITECUSTOMIZE = """
import atexit, os
RANK = os.environ.get("RANK")


def mark(what):
    if RANK is not None:  # a rank, not the torchrun launcher
        open(os.path.join(os.environ["MARKS"], f"{what}-rank{RANK}"), "w").close()


class AtTeardown:
    # what it needs is bound now: at teardown module globals and builtins may be gone already
    def __del__(self, _open=os.open, _close=os.close, _flags=os.O_CREAT | os.O_WRONLY,
                path=os.path.join(os.environ.get("MARKS", ""), f"teardown-rank{RANK}")):
        if RANK is not None:
            _close(_open(path, _flags))


atexit.register(mark, "atexit")
at_teardown = AtTeardown()  # freed when the interpreter tears the modules down
"""


@pytest.mark.parametrize("refused", [False, True], ids=["success", "refused"])
def test_the_command_line_ends_each_rank_after_its_exit_handlers_without_interpreter_teardown(
        tmp_path, refused):
    # Interpreter teardown is where gloo can abort a rank after a run that succeeded (SIGABRT,
    # "terminate called without an active exception"): saferun run ends its ranks before it,
    # after every atexit handler ran, with the status the run ended with
    marks = tmp_path / "marks"
    marks.mkdir()
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MARKS": str(marks),
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         f"--master_port={free_port()}", "-m", "saferun", "run", "debug=fast",
         "trainer.progress_bar=false", *(["trainer.max_steps=-1"] if refused else [])],
        cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert proc.returncode == (1 if refused else 0), proc.stdout + proc.stderr
    left = sorted(p.name for p in marks.iterdir())
    if refused:  # the first rank to end with 1 makes torchrun stop the other, maybe before its end
        assert left in (["atexit-rank0"], ["atexit-rank1"], ["atexit-rank0", "atexit-rank1"]), left
    else:
        assert left == ["atexit-rank0", "atexit-rank1"]


def test_a_run_directory_in_use_stops_every_rank_with_the_reason(tmp_path):
    from saferun.checkpoint import rundir

    run_dir = tmp_path / "run"
    held = rundir.claim(str(run_dir))  # this process writes there; rank 0 must not
    try:
        proc = torchrun(plain_config(run_dir, batch_size=16), {"plain": True})
    finally:
        held.release()
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert out.count(f"run directory {run_dir} is in use by another run (pid {os.getpid()} ") >= 2
    assert not (run_dir / "checkpoints").exists()


@pytest.mark.slow  # two torchrun jobs; one process: tests/checkpoint/test_fresh_start.py
def test_a_fresh_start_over_another_run_stops_every_rank_and_resume_fresh_sets_it_aside_once(tmp_path):
    from toys import ToyTrainer

    run_dir = tmp_path / "run"
    ToyTrainer(plain_config(run_dir, batch_size=16, save_every_n_steps=4)).fit()
    files = lambda path: {p.relative_to(path).as_posix(): p.read_bytes()  # noqa: E731
                          for p in path.rglob("*") if p.is_file() and p.name != ".saferun.lock"}
    earlier = files(run_dir)
    proc = torchrun(plain_config(run_dir, batch_size=16), {"plain": True})
    assert proc.returncode != 0
    assert (proc.stdout + proc.stderr).count(f"the run directory {run_dir} holds the checkpoints "
                                             f"of another run (the latest: step 8") >= 2
    assert files(run_dir) == earlier  # no rank wrote anything
    cfg = plain_config(run_dir, batch_size=16, save_every_n_steps=4)
    cfg["resume"] = "fresh"
    proc = torchrun(cfg, {"plain": True})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [aside] = [p for p in run_dir.iterdir() if p.name.startswith("superseded-")]
    assert files(aside) == earlier
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == [
        "step-00000004", "step-00000008"]
    assert all(torch.equal(a, b) for a, b in zip(rank_weights(run_dir, 0).values(),
                                                    rank_weights(run_dir, 1).values()))
