"""saferun's Optuna sweeper: the search space from Hydra's override grammar (fast), and real
studies through the real command line (slow)."""

import json
import sqlite3

import pytest
import torch
import yaml

from saferun.sweep.study import run_study, search_space, suggest
from sweep_cli import FAST, saferun_cli

optuna = pytest.importorskip("optuna")


def test_the_override_grammar_becomes_optunas_distributions():
    space, fixed = search_space(["recipe=tabular", "optim.lr=tag(log,interval(1e-4,1e-2))",
                                 "trainer.batch_size=range(16,65,16)", "optim=choice(adamw,sgd)",
                                 "trainer.accumulate=tag(int,interval(1,4))", "seed=0,1"])
    assert fixed == ["recipe=tabular"]
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    trial = study.ask()
    values = {key: suggest(trial, key, override) for key, override in space.items()}
    d = trial.distributions
    assert d["optim.lr"] == optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True)
    assert d["trainer.batch_size"] == optuna.distributions.IntDistribution(16, 64, step=16)
    assert d["optim"] == optuna.distributions.CategoricalDistribution(["adamw", "sgd"])
    assert d["trainer.accumulate"] == optuna.distributions.IntDistribution(1, 4)
    assert d["seed"] == optuna.distributions.CategoricalDistribution(["0", "1"])
    assert float(values["optim.lr"]) == trial.params["optim.lr"]  # the override is the value
    assert int(values["trainer.batch_size"]) in (16, 32, 48, 64)


def test_the_sweeper_config_composes_to_saferuns_plugin_and_an_optuna_sampler():
    from hydra import compose, initialize_config_module
    from hydra.utils import get_class, instantiate

    from hydra.plugins.sweeper import Sweeper

    from saferun.cli import _register_with_hydra

    _register_with_hydra()
    with initialize_config_module(config_module="saferun.conf", version_base="1.3"):
        cfg = compose("config", overrides=["hydra/sweeper=optuna", "hydra.sweep.dir=/s"],
                      return_hydra_config=True)
    sweeper = cfg.hydra.sweeper
    # (Hydra's plugin scan executes the module again: compare the class by name)
    plugin = get_class(sweeper._target_)
    assert issubclass(plugin, Sweeper) and plugin.__name__ == "OptunaSweeper"
    assert sweeper.storage == "sqlite:////s/optuna.db" and sweeper.n_trials == 20
    assert isinstance(instantiate(sweeper.sampler), optuna.samplers.TPESampler)


class Scoring:
    """A launcher whose jobs score their overrides at once (trainings are the slow test's):
    the objective is the drawn learning rate, so each trial's value is its point."""

    def launch(self, job_overrides, initial_job_idx):
        from hydra.core.utils import JobReturn, JobStatus

        returns = []
        for overrides in job_overrides:
            ret = JobReturn()
            ret.status = JobStatus.COMPLETED
            ret.return_value = float(next(o for o in overrides if o.startswith("optim.lr="))[9:])
            returns.append(ret)
        return returns


def study_points(tmp_path, *runs, sampler=None, name="s"):
    """Run the study over the same storage once per n_trials in `runs`; each trial's point."""
    from omegaconf import OmegaConf

    config = OmegaConf.create({"sweep": {"metric": None, "mode": None},
                               "trainer": {"save_best": None, "save_best_mode": None},
                               "hydra": {"sweep": {"dir": str(tmp_path)}}})
    sampler = sampler or {"_target_": "optuna.samplers.TPESampler", "seed": 0}
    for n in runs:
        settings = {"n_trials": n, "n_jobs": 1, "study_name": name, "params": {},
                    "storage": f"sqlite:///{tmp_path}/optuna.db", "sampler": OmegaConf.create(sampler)}
        study = run_study(settings, config, Scoring(), ["optim.lr=tag(log,interval(1e-4,1e-2))"])
    return [t.params["optim.lr"] for t in study.trials]


def test_a_continued_study_draws_on_as_an_uninterrupted_one(tmp_path):
    """A rerun rebuilt the sampler with its seed: trials 2, 3 drew trials 0, 1's points again."""
    continued = study_points(tmp_path / "a", 2, 4)
    assert len(set(continued)) == 4
    assert continued == study_points(tmp_path / "b", 4)
    assert continued[:3] == study_points(tmp_path / "c", 1, 3, 3)  # a rerun with nothing to do


@pytest.mark.parametrize("first, then", [
    # a study without the sampler's state (made by hand, or by an earlier saferun): seeded
    # from the study's state
    (None, {"_target_": "optuna.samplers.TPESampler", "seed": 0}),
    # another sampler config continues no stream: its own, seeded from the study's state
    # (TPE's first trials are RandomSampler's draws of the same seed)
    ({"_target_": "optuna.samplers.TPESampler", "seed": 0},
     {"_target_": "optuna.samplers.RandomSampler", "seed": 0}),
])
def test_a_study_without_this_samplers_state_is_seeded_from_the_study(tmp_path, first, then):
    if first is None:
        study = optuna.create_study(study_name="s", storage=f"sqlite:///{tmp_path}/optuna.db",
                                    sampler=optuna.samplers.TPESampler(seed=0))
        for _ in range(2):
            trial = study.ask()
            study.tell(trial, trial.suggest_float("optim.lr", 1e-4, 1e-2, log=True))
    else:
        study_points(tmp_path, 2, sampler=first)
    points = study_points(tmp_path, 4, sampler=then)
    assert len(set(points)) == 4


def trials(db):
    with sqlite3.connect(db) as c:
        return c.execute("SELECT number, state FROM trials ORDER BY number").fetchall()


@pytest.mark.slow  # two short trainings
def test_an_in_memory_study_runs_its_trials_and_names_the_best(tmp_path):
    proc = saferun_cli("-m", *FAST, "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2",
                       "hydra.sweeper.storage=null", "optim.lr=tag(log,interval(1e-4,1e-2))",
                       "hydra.sweep.dir=sweep", cwd=tmp_path)
    sweep = tmp_path / "sweep"
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    summaries = {n: json.loads((sweep / n / "summary.json").read_text()) for n in ("0", "1")}
    best = min(summaries, key=lambda n: summaries[n]["objective"]["value"])
    assert results["best_trial"] == int(best) and results["metric"] == "val/loss"
    assert results["best_value"] == summaries[best]["objective"]["value"]
    assert results["best_run_dir"] == str(sweep / best)
    assert f"optim.lr={results['best_params']['optim.lr']}" in summaries[best]["overrides"]
    assert isinstance(results["best_params"]["optim.lr"], float)  # a number, not its text
    table = (sweep / "summary.txt").read_text().splitlines()
    assert table[1].startswith(f"best: job {best} (") and table[4].startswith(f"*  {best}")
    assert "sweep summary" in proc.stdout and not (sweep / "optuna.db").exists()


@pytest.mark.slow  # three trials over two sweeps, and one plain run
def test_an_interrupted_study_continues_its_trials_and_resumes_the_interrupted_one(tmp_path):
    once = tmp_path / "signalled"
    args = ["-m", *FAST, "hydra/sweeper=optuna", "hydra.sweeper.n_trials=3",
            "optim.lr=tag(log,interval(1e-4,1e-2))", "hydra.sweep.dir=sweep",
            "+callbacks.stop._target_=sweep_toys.SignalAt", "+callbacks.stop.steps=[3]",
            "+callbacks.stop.signum=SIGTERM", f"+callbacks.stop.once_file={once}"]
    first = saferun_cli(*args, cwd=tmp_path, check=False)  # SIGTERM in trial 0, after step 3
    assert first.returncode == 143, first.stdout + first.stderr
    db = tmp_path / "sweep" / "optuna.db"
    assert trials(db) == [(0, "RUNNING")]  # left for the rerun
    saferun_cli(*args, cwd=tmp_path)
    assert trials(db) == [(0, "COMPLETE"), (1, "COMPLETE"), (2, "COMPLETE")]
    sweep = tmp_path / "sweep"
    trial0 = json.loads((sweep / "0" / "summary.json").read_text())
    assert "resume=auto" in trial0["overrides"] and trial0["step"] == 10
    # the resumed trial ends as an uninterrupted run of its configuration
    lr = next(o for o in trial0["overrides"] if o.startswith("optim.lr="))
    saferun_cli(*FAST, lr, "hydra.run.dir=plain", cwd=tmp_path)
    for name in ("model.pt",):
        a, b = torch.load(sweep / "0" / name), torch.load(tmp_path / "plain" / name)
        assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    steps = [json.loads(x)["step"] for x in (sweep / "0" / "metrics.jsonl").read_text().splitlines()]
    plain = [json.loads(x)["step"] for x in (tmp_path / "plain" / "metrics.jsonl").read_text().splitlines()]
    assert steps == plain  # each step logged once
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert results["best_trial"] in (0, 1, 2) and len((sweep / "summary.txt").read_text().splitlines()) == 7


def test_the_best_params_are_written_as_the_values_they_stand_for(tmp_path):
    """optimization_results.yaml: optim.lr a float, a batch size an int, an optimizer a string."""
    from saferun.sweep.objective import objective_of
    from saferun.sweep.study import _write_results

    study = optuna.create_study()
    trial = study.ask()
    trial.set_user_attr("overrides", {"optim.lr": "0.003", "trainer.batch_size": "32", "optim": "sgd"})
    study.tell(trial, 0.5)
    _write_results(study, tmp_path, objective_of(None, None, None, None))
    results = yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())
    assert results["best_params"] == {"optim.lr": 0.003, "trainer.batch_size": 32, "optim": "sgd"}
    assert [type(v) for v in results["best_params"].values()] == [float, int, str]


@pytest.mark.slow  # eight short trainings over three sweeps
def test_a_sweep_continued_from_2_to_4_trials_draws_as_one_of_4(tmp_path):
    """The real command line: a rerun of a finished 2-trial sweep with n_trials=4 draws two new
    points, those an uninterrupted 4-trial sweep draws (it drew trials 0 and 1's again)."""
    args = ["-m", *FAST, "hydra/sweeper=optuna", "optim.lr=tag(log,interval(1e-4,1e-2))"]
    for n in (2, 4):
        saferun_cli(*args, f"hydra.sweeper.n_trials={n}", "hydra.sweep.dir=continued", cwd=tmp_path)
    saferun_cli(*args, "hydra.sweeper.n_trials=4", "hydra.sweep.dir=once", cwd=tmp_path)

    def points(sweep):
        with sqlite3.connect(tmp_path / sweep / "optuna.db") as c:
            drawn = c.execute("SELECT t.number, p.param_value FROM trial_params p JOIN trials t "
                              "ON p.trial_id = t.trial_id ORDER BY t.number").fetchall()
        jobs = [next(o for o in json.loads((tmp_path / sweep / str(n) / "summary.json").read_text())
                     ["overrides"] if o.startswith("optim.lr=")) for n in range(4)]
        assert [f"optim.lr={v!r}" for _, v in drawn] == jobs  # each job ran its trial's point
        return [v for _, v in drawn]

    continued = points("continued")
    assert len(set(continued)) == 4 and continued == points("once")
