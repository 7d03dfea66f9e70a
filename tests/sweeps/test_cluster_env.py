"""The environment of a SLURM job, as SLURM sets it, read by submitit and turned into what
torch.distributed's env:// rendezvous reads (what torchrun would set); the extras' messages."""

import importlib.util

import pytest

from saferun.sweep.cluster import prepare_multirun, torch_env

submitit = pytest.importorskip("submitit")

# Process 5 of a 2-node job with 4 tasks per node: the second task on the second node.
SLURM = {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "4242", "SLURM_PROCID": "5",
         "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_JOB_NUM_NODES": "2",
         "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[07-08]"}


def slurm_job(monkeypatch, **env):
    for key in ("MASTER_PORT", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in {**SLURM, **env}.items():
        monkeypatch.setenv(key, value)
    job = submitit.JobEnvironment()
    assert type(job).__name__ == "SlurmJobEnvironment"
    return job


def test_a_slurm_process_gets_torchruns_variables(monkeypatch):
    env = torch_env(slurm_job(monkeypatch))
    port = env.pop("MASTER_PORT")
    assert env == {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
                   "MASTER_ADDR": "gpu07"}  # the first host of the node list: rank 0's
    assert 20000 <= int(port) < 40000
    # the same job (requeued: SLURM keeps its id) meets on the same port; another job elsewhere
    assert torch_env(slurm_job(monkeypatch, SLURM_PROCID="0", SLURM_LOCALID="0"))["MASTER_PORT"] == port
    assert torch_env(slurm_job(monkeypatch, SLURM_JOB_ID="4243"))["MASTER_PORT"] != port
    # each task of an array job (a sweep's jobs) is its own torch job
    ports = {torch_env(slurm_job(monkeypatch, SLURM_ARRAY_JOB_ID="4240", SLURM_ARRAY_TASK_ID=t)
                       )["MASTER_PORT"] for t in ("1", "2")}
    assert len(ports) == 2
    # a port the user exported wins
    assert torch_env(slurm_job(monkeypatch, MASTER_PORT="29500"))["MASTER_PORT"] == "29500"


def test_a_node_list_of_several_groups_gives_its_first_host(monkeypatch):
    job = slurm_job(monkeypatch, SLURM_JOB_NODELIST="a[3,5-6],b1", SLURM_NTASKS="4",
                    SLURM_JOB_NUM_NODES="4")
    assert torch_env(job)["MASTER_ADDR"] == "a3" and torch_env(job)["LOCAL_WORLD_SIZE"] == "1"


@pytest.mark.parametrize("choice, extra", [("hydra/sweeper=optuna", "sweep"),
                                           ("hydra/launcher=submitit_slurm", "slurm")])
def test_a_missing_extra_names_the_install_command(monkeypatch, capsys, choice, extra):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None
                        if name in ("optuna", "hydra_plugins.hydra_submitit_launcher") else real(name, *a))
    with pytest.raises(SystemExit) as exit_:
        prepare_multirun(["recipe=tabular", choice])
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert f"saferun: error: {choice} needs the" in err and f"pip install 'saferun[{extra}]'" in err


def test_hydras_sweeper_and_launcher_choices_pass_saferuns_key_check():
    from saferun.config import Config
    from saferun.suggest import unknown_override

    assert unknown_override(["hydra/sweeper=optuna", "hydra/launcher=submitit_slurm",
                             "hydra.launcher.nodes=2"], Config) is None
    assert "hydraa/sweeper" in unknown_override(["hydraa/sweeper=optuna"], Config)
