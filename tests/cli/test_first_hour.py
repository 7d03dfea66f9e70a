"""A new user's first hour on the command line (issue 36): documented options that work as
written, and for each mistake one `saferun: error:` line that names the key, the cause and the
fix, with no traceback and nothing left on disk."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra.utils import get_class

ROOT = Path(__file__).resolve().parents[2]
FAST = ["debug=fast", "trainer.progress_bar=false"]


def saferun(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "saferun", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("option", ["mlflow", "wandb"])
def test_every_option_of_a_tracker_is_a_key_of_its_config_node(option):
    """`logger.wandb.mode=online` (docs/logging.md) and `logger.mlflow.tracking_uri=...` (the
    option's own comment) need no `+`: the node lists each argument of its logger."""
    from saferun.cli import compose_config

    node = yaml.safe_load((ROOT / "conf" / "logger" / f"{option}.yaml").read_text())[option]
    arguments = set(inspect.signature(get_class(node["_target_"])).parameters)
    assert set(node) - {"_target_"} == arguments
    value = {"mlflow": "http://127.0.0.1:5000", "wandb": "online"}
    key = {"mlflow": "tracking_uri", "wandb": "mode"}[option]
    config = compose_config([f"logger={option}", f"logger.{option}.{key}={value[option]}"])
    assert config.logger[option][key] == value[option]


def test_check_help_prints_its_usage(tmp_path):
    proc = saferun("check", "--help", cwd=tmp_path)
    assert proc.returncode == 0 and "usage: saferun check" in proc.stdout, proc.stderr
    assert "Traceback" not in proc.stderr and list(tmp_path.iterdir()) == []


def test_cfg_job_after_the_overrides_prints_the_config(tmp_path):
    """Hydra's flags may come after the overrides; Hydra's parser alone wants them first."""
    proc = saferun("run", "recipe=digits", "--cfg", "job", "optim=sgd", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "_target_: torch.optim.SGD" in proc.stdout and "output_subdir" not in proc.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, words", [
    (["--resume"], ["'--resume'", "resume=auto"]),
    (["--max_steps", "5"], ["'--max_steps'", "trainer.max_steps=5"]),
    (["--lr=0.1"], ["'--lr=0.1'", "optim.lr=0.1"]),
])
@pytest.mark.parametrize("command", ["run", "check"])
def test_an_unknown_flag_names_the_override_meant(tmp_path, command, args, words):
    proc = saferun(command, *FAST, *args, cwd=tmp_path)
    assert proc.returncode != 0
    error = proc.stderr.strip().splitlines()
    assert len(error) == 1 and error[0].startswith(f"saferun{' check' * (command == 'check')}: error:"), proc.stderr
    for w in words:
        assert w in error[0]
    assert "output_subdir" not in proc.stderr and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("uri, words", [
    ("http://127.0.0.1:{port}", ["no MLflow server answers there", "Connection refused"]),
    ("htp://127.0.0.1:{port}", ["no store for 'htp://'"]),
])
def test_an_mlflow_server_that_is_not_there_is_refused_before_training(tmp_path, uri, words):
    """Loopback only, on a port nothing listens on: refused within seconds, not after minutes of
    MLflow's retries (the subprocess' limit fails the test first)."""
    pytest.importorskip("mlflow")
    from helpers import free_port

    uri = uri.format(port=free_port())
    proc = subprocess.run([sys.executable, "-m", "saferun", "run", *FAST, "logger=mlflow",
                           f"logger.mlflow.tracking_uri={uri}"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1
    error = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(error) == 1 and error[0].startswith(f"saferun: error: logger.mlflow.tracking_uri={uri}: ")
    for w in words:
        assert w in error[0]
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.rglob("*")) == [], list(tmp_path.rglob("*"))  # no run directory, no mlflow.db


@pytest.mark.parametrize("args, meant", [(["--checkpoint", "best"], "checkpoint=best"),
                                         (["--out-dir=runs/t"], "out_dir=runs/t")])
def test_saferun_test_with_an_option_flag_names_the_key_value_form(tmp_path, args, meant):
    proc = saferun("test", "runs/tab", *args, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"saferun test: error: {args[0].split('=')[0]} is not an option: "
                                  f"write {meant}"), proc.stderr
    assert "Traceback" not in proc.stderr and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("override, words", [
    ("optim.lr=interval(1e-2,1e-4)", ["'optim.lr=interval(1e-2,1e-4)'", "interval(0.0001,0.01)"]),
    ("optim.lr=tag(log,interval(0,1e-2))", ["a log scale needs bounds above 0"]),
    ("hydra.sweeper.n_trials=0", ["hydra.sweeper.n_trials=0", "at least one trial"]),
    ("hydra.sweeper.n_trial=3", ["hydra.sweeper.n_trial'", "Did you mean hydra.sweeper.n_trials?"]),
])
def test_an_optuna_search_space_mistake_names_the_override_and_leaves_nothing(tmp_path, override, words):
    pytest.importorskip("optuna")
    proc = saferun("run", "-m", "recipe=tabular", "hydra/sweeper=optuna", override, *FAST, cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("saferun: error: "), proc.stderr
    for w in words:
        assert w in proc.stderr
    assert list(tmp_path.rglob("*")) == []  # no sweep folder, no optuna.db


@pytest.mark.parametrize("sweep, words", [
    ("optim.lr=1e-3,-1", ["job with optim.lr=-1 would be refused", "optim.lr must be >= 0"]),
    ("optim=adamw,sgdd", ["job with optim=sgdd would be refused", "optim/sgdd"]),
])
def test_a_grid_sweep_with_one_bad_value_is_refused_before_any_job(tmp_path, sweep, words):
    proc = saferun("run", "-m", *FAST, sweep, cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("saferun: error: "), proc.stderr
    for w in words:
        assert w in proc.stderr
    assert "saferun: done" not in proc.stdout and list(tmp_path.rglob("*")) == []


# Beyond the list: the command lines a new user tries, each with the words its one error line
# must hold (the key, the cause, the fix). Each is refused before anything is written.
BAD_COMMAND_LINES = [
    (["trainer.num_train_epochs=3"], ["trainer.num_train_epochs", "Did you mean trainer.max_epochs?"]),
    (["+trainer.warmup=100"], ["trainer.warmup", "Did you mean sched.warmup_steps?"]),
    (["optimizer.lr=0.1"], ["optimizer.lr", "Did you mean optim.lr?"]),
    (["trainer.max_epochs=-1"], ["trainer.max_epochs must be > 0 or null"]),
    (["trainer.precision=fp8"], ["trainer.precision must be one of fp32, bf16, fp16"]),
    (["guards.nonfinite=ignore"], ["guards.nonfinite must be one of raise, skip, rollback, off"]),
    (["trainer.device=gpu"], ["trainer.device", "Use auto, cpu, cuda or cuda:N"]),
    (["seed=abc"], ["seed: Value 'abc'", "Integer"]),
    (["trainer.max_steps=1.5"], ["trainer.max_steps: Value '1.5'", "Integer"]),
    (["sched=cosin"], ["Could not find 'sched/cosin'", "constant, cosine"]),
    (["logger.wandb.mode=online"], ["logger.wandb is not in the config", "logger=wandb logger.wandb.mode="]),
    (["callbacks.early.patience=3"], ["there is no callback 'early'", "+callbacks.early._target_="]),
]


@pytest.mark.parametrize("args, words", BAD_COMMAND_LINES, ids=[" ".join(a) for a, _ in BAD_COMMAND_LINES])
def test_a_mistaken_command_line_gets_one_error_line_and_leaves_nothing(tmp_path, args, words):
    proc = saferun("run", *FAST, *args, cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("saferun: error: "), proc.stderr
    for w in words:
        assert w in proc.stderr, proc.stderr
    assert list(tmp_path.rglob("*")) == []


@pytest.mark.parametrize("args", [["trainer.num_train_epochs=3"], ["sched=cosin"], ["seed=abc"],
                                  ["--bogus"]], ids=lambda a: a[0])
def test_a_command_line_refused_before_the_job_never_imports_torch(tmp_path, args):
    # A misspelt key, group option or type is refused in a fraction of a second: torch's import
    # (two seconds and more) comes with the job. The command's own entry point, in a process of
    # its own, reports what it imported.
    code = ("import sys\nfrom saferun.cli import main\ntry:\n    main(['run', *sys.argv[1:]])\n"
            "except SystemExit as e:\n    print(e.code, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code, *FAST, *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.stderr.startswith("saferun: error: "), proc.stderr
    exit_code, imported_torch = proc.stdout.split()
    assert exit_code != "0" and imported_torch == "False", proc.stdout


@pytest.mark.parametrize("args, warned", [
    (["task._target_=saferun.recipes.tabular.TabularTrainer"], True),  # digits' settings stay
    (["task._target_=saferun.recipes.tabular.TabularTrainer", "recipe=tabular"], False),
    (["~recipe", "++task._target_=saferun.recipes.tabular.TabularTrainer"], False),
    (["recipe=charlm"], False),
])
def test_a_trainer_named_without_a_recipe_is_told_it_keeps_the_default_recipes_settings(
        tmp_path, args, warned):
    """`saferun run/check task._target_=X` alone runs X with the digits recipe's model, data,
    learning rate and limits (issue 33): legitimate, so not refused, but said."""
    proc = saferun("run", *args, "--cfg", "job", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    said = [line for line in proc.stderr.splitlines() if line.startswith("saferun: warning:")]
    assert bool(said) == warned, proc.stderr
    if warned:
        assert "conf/recipe/digits.yaml" in said[0] and "~recipe" in said[0]
        assert "lr: 0.003" in proc.stdout  # what the warning says: the recipe's value is there
