"""The threads plan (trainer.num_threads, saferun/loop/threads.py): what it chooses for given
cores, loader workers and local processes, that an explicit value and the user's
OMP_NUM_THREADS win, and that OpenMP really takes the wait policy the saferun command sets."""

import logging
import os
import subprocess
import sys

import pytest
import torch

from saferun.errors import ConfigError
from saferun.config import load_config
from saferun.loop.threads import apply_plan, busy_cores_elsewhere, plan_threads
from toys import ToyTrainer, toy_config


@pytest.mark.parametrize("cores, local, workers, chosen", [
    (16, None, 0, 16),  # one process, no workers: every core it may use
    (16, "4", 0, 4),  # torchrun, 4 processes on the node: a quarter each
    (16, "4", 2, 2),  # ... less the loader workers computing beside each
    (2, None, 2, 1),  # more workers than cores: still one thread
    (4, "8", 0, 1),  # more processes than cores
    (12, "junk", 3, 9),  # an unreadable LOCAL_WORLD_SIZE counts as one process
])
def test_auto_gives_each_process_its_share_of_the_cores(cores, local, workers, chosen):
    env = {} if local is None else {"LOCAL_WORLD_SIZE": local}
    plan = plan_threads("auto", env, cores, workers, current=cores)  # torch's default: a core each
    assert (plan.threads, plan.source) == (chosen, "auto")


def test_auto_never_raises_the_threads_torch_has():
    # a script's (or a test harness's) own torch.set_num_threads(1) stays
    assert plan_threads("auto", {}, 16, 0, current=1).threads == 1
    assert plan_threads("auto", {}, 16, 2, current=8).threads == 8
    assert plan_threads(12, {}, 16, 0, current=1).threads == 12  # an explicit value may raise it


def test_the_users_omp_num_threads_wins_over_auto_and_an_explicit_value_over_both():
    env = {"OMP_NUM_THREADS": "3", "LOCAL_WORLD_SIZE": "2"}
    assert plan_threads("auto", env, 16, 0, 16).threads is None  # torch took it at start-up
    assert plan_threads("auto", env, 16, 0, 16).source == "OMP_NUM_THREADS"
    assert plan_threads(5, env, 16, 0, 16).threads == 5
    assert plan_threads("auto", {"OMP_NUM_THREADS": ""}, 8, 0, 8).threads == 8  # empty: not set


def never(*_):
    raise AssertionError("measured where it cannot change the plan")


@pytest.mark.parametrize("cores, busy, chosen", [
    (2, 0.3, 2),  # a quiet machine: every core
    (2, 0.9, 1),  # one busy process beside a 2-core job: the free core only
    (8, 2.6, 5),  # three cores busy elsewhere
    (4, 9.0, 1),  # more busy than there are cores: still one thread
])
def test_auto_alone_on_the_node_leaves_out_the_cores_other_work_keeps_busy(cores, busy, chosen):
    plan = plan_threads("auto", {}, cores, 0, current=cores, busy_elsewhere=lambda: busy)
    assert (plan.threads, plan.busy) == (chosen, cores - chosen)
    assert (f"- {cores - chosen} busy with other work" in apply_plan(plan)) == (chosen < cores)


def test_other_work_is_measured_only_where_it_can_change_the_plan():
    assert plan_threads("auto", {}, 8, 0, current=1, busy_elsewhere=never).threads == 1
    assert plan_threads("auto", {}, 2, 1, current=2, busy_elsewhere=never).threads == 1  # a worker
    # under torchrun the other ranks, busy starting up, are not other work
    assert plan_threads("auto", {"LOCAL_WORLD_SIZE": "2"}, 8, 0, 8, busy_elsewhere=never).threads == 4
    assert plan_threads("auto", {"OMP_NUM_THREADS": "2"}, 8, 0, 8, busy_elsewhere=never).threads is None
    assert plan_threads(3, {}, 8, 0, 8, busy_elsewhere=never).threads == 3


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2
                    or not os.path.exists("/proc/stat"), reason="Linux with two cores")
def test_a_process_spinning_beside_this_one_is_measured_as_a_busy_core_and_this_one_is_not():
    import threading
    import time

    before = busy_cores_elsewhere(0.3)  # whatever else the machine is doing
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # started and spinning
        assert busy_cores_elsewhere(0.3) >= min(before + 0.6, 1.6)
    finally:
        spinner.kill()
        spinner.wait()
    stop = threading.Event()
    mine = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)])  # spins here
    mine.start()
    try:
        time.sleep(0.1)
        # this process's own spinning thread is not counted (it would add a whole core); the
        # margin takes the 10 ms ticks of /proc/stat and a shared VM's stolen time
        assert busy_cores_elsewhere(0.3) <= max(before, 0.0) + 0.7
    finally:
        stop.set()
        mine.join()


@pytest.mark.parametrize("bad", ["two", 0, -1, 1.5, True])
def test_a_bad_num_threads_is_refused_naming_the_key(bad):
    with pytest.raises(ConfigError, match="trainer.num_threads must be auto or a number"):
        load_config({"trainer": {"num_threads": bad}})


@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_trainer_sets_the_planned_threads_and_says_so_once(tmp_path, torch_threads, caplog,
                                                              monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    with caplog.at_level(logging.INFO, logger="saferun"):
        ToyTrainer(toy_config(tmp_path, max_steps=2, num_threads=1)).fit()
    assert torch.get_num_threads() == 1
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("threads:")]
    assert len(said) == 1 and said[0].startswith("threads: 1 intra-op"), said
    assert "(trainer.num_threads)" in said[0]


def test_auto_counts_the_loader_workers(tmp_path, torch_threads, caplog, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)  # torch's default
    with caplog.at_level(logging.INFO, logger="saferun"):
        ToyTrainer(toy_config(tmp_path, max_steps=1, num_workers=1)).fit()  # said once accepted
    assert torch.get_num_threads() == max(1, cores - 1)
    assert any(f"auto: {cores} cores this process may use / 1 process on the node - 1 loader "
               f"worker = {max(1, cores - 1)};" in r.getMessage() for r in caplog.records)


def test_the_environments_omp_num_threads_is_left_as_torch_took_it(tmp_path, torch_threads,
                                                                   caplog, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)  # what torch did with it at start-up
    with caplog.at_level(logging.INFO, logger="saferun"):
        ToyTrainer(toy_config(tmp_path, max_steps=1)).validate()  # said by every entry point
    assert torch.get_num_threads() == 1
    assert any("OMP_NUM_THREADS=1 from the environment wins" in r.getMessage()
               for r in caplog.records)


def spin_count(code, **env):
    """GOMP_SPINCOUNT as torch's OpenMP runtime (libgomp) reports it after `code` ran."""
    environ = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    environ.update(OMP_DISPLAY_ENV="VERBOSE", **env)
    out = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stderr.splitlines() if "GOMP_SPINCOUNT" in x)
    return int(line.split("'")[1])


def test_the_saferun_command_stops_openmp_threads_spinning_unless_the_user_chose():
    # libgomp reads OMP_WAIT_POLICY when torch loads it: the command sets it before that.
    command = "from saferun.cli import main; main(['--help']); import torch"
    assert spin_count(command) == 0  # passive: an idle thread sleeps at once
    assert spin_count("import torch") == 300000  # torch's default: it spins first
    assert spin_count(command, OMP_WAIT_POLICY="ACTIVE") > 300000  # the user's choice wins
