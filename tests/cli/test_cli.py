"""The real `saferun` command in a subprocess, run from a directory outside the repository."""

import json
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

FAST = ["debug=fast", "trainer.progress_bar=false"]


def saferun(*args, cwd, check=True):
    proc = subprocess.run([sys.executable, "-m", "saferun", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"saferun {' '.join(args)} failed ({proc.returncode}):\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc


def test_run_writes_config_summary_and_tensorboard_and_prints_the_run_dir(tmp_path):
    proc = saferun("run", *FAST, cwd=tmp_path)
    runs = list((tmp_path / "runs" / "digits").iterdir())
    assert len(runs) == 1
    run_dir = runs[0]
    assert proc.stdout.count(f"run directory {run_dir}") == 2  # at start and at end
    # a new directory: nothing set aside (Hydra's saferun.log, opened empty, is this run's)
    assert not list(run_dir.glob("superseded-*")) and "step 10/10" in (run_dir / "saferun.log").read_text()
    assert (run_dir / ".hydra" / "overrides.yaml").read_text().splitlines() == [f"- {a}" for a in FAST]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["step"] == 10 and summary["overrides"] == FAST
    assert 0.0 <= summary["metrics"]["val/acc"] <= 1.0
    assert 0.0 <= summary["metrics"]["val/f1"] <= 1.0  # the recipe's torchmetrics macro-F1
    # where the last log point's step went (loop/steptimer.py), with the other perf/*
    split = [summary["metrics"][f"perf/{k}_ms"] for k in ("data_wait", "forward_backward", "optimizer", "guards")]
    assert min(split) >= 0.0 and sum(split) <= summary["metrics"]["perf/step_ms"], split
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["kind"] == "train"] == [2, 4, 6, 8, 10]
    assert lines[-1]["kind"] == "val" and lines[-1]["val/f1"] == summary["metrics"]["val/f1"]
    assert "_target_: saferun.recipes.digits.DigitsTrainer" in (run_dir / "config.yaml").read_text()
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [2, 4, 6, 8, 10]


def test_multirun_gives_each_job_a_directory_and_prints_a_summary(tmp_path):
    from tensorboard.plugins.hparams import plugin_data_pb2

    # a metric added on the command line (the README's example), beside the recipe's val/f1
    proc = saferun("run", "-m", *FAST, "optim.lr=1e-3,3e-3", "trainer.ema.decay=0.9",
                   "+metrics.auroc._target_=torchmetrics.classification.MulticlassAUROC",
                   "+metrics.auroc.num_classes=10", "hydra.sweep.dir=sweep", cwd=tmp_path)
    for job, lr in (("0", 1e-3), ("1", 3e-3)):
        summary = json.loads((tmp_path / "sweep" / job / "summary.json").read_text())
        assert summary["step"] == 10 and "val_ema/acc" in summary["metrics"]
        assert {"val/auroc", "val/f1", "val_ema/auroc"} <= set(summary["metrics"])
        assert (tmp_path / "sweep" / job / "model_ema.pt").is_file()
        # the HParams view: one table over the sweep's runs, each with its lr and metrics
        acc = EventAccumulator(str(tmp_path / "sweep" / job / "tensorboard"))
        acc.Reload()
        data = {tag: plugin_data_pb2.HParamsPluginData.FromString(raw)
                for tag, raw in acc.PluginTagToContent("hparams").items()}
        assert data["_hparams_/session_start_info"].session_start_info.hparams[
            "optim.lr"].number_value == pytest.approx(lr)
        assert {"val/acc", "val/f1", "val_ema/acc", "val/auroc"} <= {
            m.name.tag for m in data["_hparams_/experiment"].experiment.metric_infos}
    table = (tmp_path / "sweep" / "summary.txt").read_text().splitlines()
    assert table[0].startswith("2 jobs ranked by val/loss (min)") and "val/acc" in table[3]
    jobs = {line.split()[-1]: line.lstrip("* ").split()[0] for line in table[4:]}
    assert jobs == {"optim.lr=0.001": "0", "optim.lr=0.003": "1"}
    assert table[4].startswith("*")  # the best job (tests/sweeps/test_summary.py: the ranking)
    assert "sweep summary" in proc.stdout


def test_a_sweep_a_job_stops_still_summarizes_the_jobs_that_finished(tmp_path):
    # job 1 diverges (non-finite at its first log point): the sweep stops there with its error,
    # job 2 never runs, and job 0's result is in summary.txt, not only in the scroll-back
    proc = saferun("run", "-m", *FAST, "optim.lr=1e-3,1e30,2e-3", "hydra.sweep.dir=sweep",
                   cwd=tmp_path, check=False)
    assert proc.returncode == 1 and "non-finite values at step" in proc.stderr
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir()) == ["0", "1"]
    table = (tmp_path / "sweep" / "summary.txt").read_text().splitlines()
    assert table[0].startswith("1 jobs ranked by val/loss (min)") and "job 0" in table[1]
    assert table[3].split()[:2] == ["*", "0"] and table[4].split()[:2] == ["1", "no"]
    assert table[-1].startswith("the sweep stopped at job 1 (its error is above)")
    assert "sweep summary" in proc.stdout


def test_new_copies_a_recipe_that_runs_its_own_code(tmp_path):
    proc = saferun("new", "mydigits", "--from", "digits", cwd=tmp_path)
    copy = tmp_path / "mydigits"
    assert {p.relative_to(copy).as_posix() for p in copy.rglob("*.yaml")} == {
        "recipe/mydigits.yaml", "model/mydigits.yaml", "data/mydigits.yaml"}
    assert "saferun run -cd . recipe=mydigits" in proc.stdout
    saferun("run", "-cd", ".", "recipe=mydigits", *FAST, cwd=copy)
    resolved = next((copy / "runs" / "mydigits").glob("*/config.yaml")).read_text()
    assert "_target_: mydigits.DigitsTrainer" in resolved
    assert "_target_: mydigits.DigitsCNN" in resolved and "saferun.recipes" not in resolved
    # the copy is the user's code now: a change to it is what runs
    source = (copy / "mydigits.py").read_text()
    (copy / "mydigits.py").write_text(source.replace(
        "        images, labels = batch\n        return F.cross_entropy",
        "        raise RuntimeError('my own training_step')\n        return F.cross_entropy", 1))
    failed = saferun("run", "-cd", ".", "recipe=mydigits", *FAST, cwd=copy, check=False)
    assert failed.returncode != 0 and "my own training_step" in failed.stderr + failed.stdout


def test_resume_auto_continues_in_the_same_run_directory(tmp_path):
    run = ["run", "debug=fast", "trainer.progress_bar=false", "hydra.run.dir=stable",
           "trainer.save_every_n_steps=3", "resume=auto"]
    saferun(*run, "trainer.max_steps=6", cwd=tmp_path)  # nothing to resume: a fresh start
    proc = saferun(*run, "trainer.max_steps=9", cwd=tmp_path)
    assert "Resumed from" in proc.stdout + proc.stderr and "step 6" in proc.stdout + proc.stderr
    assert json.loads((tmp_path / "stable" / "summary.json").read_text())["step"] == 9
    # (a resume with a changed seed is refused: tests/checkpoint/test_resume.py)


@pytest.mark.parametrize("args, message", [
    (["new", "digits", "--from", "digits"], "differ from the shipped recipes"),
    (["new", "x", "--from", "digitz"], "no recipe 'digitz'"),
])
def test_new_refuses_bad_requests(tmp_path, args, message):
    proc = saferun(*args, cwd=tmp_path, check=False)
    assert proc.returncode == 2 and message in proc.stderr


def test_list_shows_recipes_and_groups(tmp_path):
    out = saferun("list", cwd=tmp_path).stdout
    assert "digits" in out and "97%" in out
    for group in ("trainer/", "optim/", "sched/", "model/", "data/", "callbacks/", "logger/", "debug/"):
        assert group in out
    assert "sgd" in out and "cosine" in out
    assert "hydra/sweeper=optuna" in out and "hydra/launcher=submitit_slurm" in out
    assert "  hydra/\n" not in out  # Hydra's own groups are not the job's config groups


@pytest.mark.parametrize("override, words", [
    ("trainer.max_steps=abc", ["trainer.max_steps", "Integer"]),
    ("trainer.max_stepz=5", ["trainer.max_stepz", "Did you mean trainer.max_steps?"]),
    ("+trainer.max_stepz=5", ["trainer.max_stepz", "Did you mean trainer.max_steps?"]),
    ("trainr.max_steps=5", ["trainr.max_steps", "Did you mean trainer.max_steps?"]),
    ("optim.lr=-0.1", ["optim.lr", ">= 0"]),
    ("trainer.max_grad_norm=0", ["trainer.max_grad_norm", "> 0"]),
    ("trainer.log_every_n_steps=0", ["trainer.log_every_n_steps", "> 0"]),
    ("trainer.frozen_modules=[featurez]", ["featurez", "features, classifier"]),
    ("optim=sgdd", ["optim/sgdd", "adamw"]),
    ("optim.lrr=0.1", ["optim.lrr"]),
    ("optim.lr=abc", ["optim.lr must be a number", "'abc'"]),
    ("lr=1e-3", ["unknown config key 'lr'", "Did you mean optim.lr?"]),
    ("trainer.run_dir=mine", ["trainer.run_dir=mine", "hydra.run.dir=DIR"]),
])
def test_bad_input_exits_non_zero_naming_the_key(tmp_path, override, words):
    proc = saferun("run", *FAST, override, cwd=tmp_path, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    for w in words:
        assert w in out, out
    assert "Traceback" not in out
    assert list(tmp_path.iterdir()) == []  # nothing left behind: no run directory, no saferun.log


@pytest.mark.slow  # three Hydra start-ups for Hydra's own flags (9 s)
def test_help_cfg_and_info_behave_as_in_hydra(tmp_path):
    help_text = saferun("run", "--help", cwd=tmp_path).stdout
    assert "== Config groups" in help_text and "optim: adam, adamw, sgd" in help_text
    job = saferun("run", "--cfg", "job", "recipe=digits", "optim=sgd", cwd=tmp_path).stdout
    assert "_target_: torch.optim.SGD" in job and "max_steps: 1500" in job
    info = saferun("run", "--info", "searchpath", cwd=tmp_path).stdout
    assert "pkg://saferun.conf" in info
    assert not (tmp_path / "runs").exists()  # none of these trains


def test_unknown_command_and_bare_command(tmp_path):
    assert "commands:" in saferun(cwd=tmp_path).stdout
    proc = saferun("trian", cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "unknown command 'trian'" in proc.stderr


def test_a_run_dir_that_cannot_be_one_is_refused_before_hydra_writes_into_it(tmp_path):
    (tmp_path / "taken").write_text("a file")
    proc = saferun("run", *FAST, "hydra.run.dir=taken", cwd=tmp_path, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "saferun: error: the run directory taken exists and is not a directory" in proc.stderr


def test_refused_resumes_leave_the_run_as_it_was(tmp_path):
    run = ["run", *FAST, "hydra.run.dir=stable", "trainer.save_every_n_steps=2", "trainer.keep_last=2"]
    run_dir = tmp_path / "stable"
    saferun(*run, "trainer.max_steps=4", cwd=tmp_path)
    written = (run_dir / "config.yaml").read_text()
    refused = saferun(*run, "trainer.max_steps=6", "resume=auto", "seed=7", cwd=tmp_path, check=False)
    assert refused.returncode == 1 and "seed: 0 -> 7" in refused.stderr
    assert (run_dir / "config.yaml").read_text() == written  # the refused values are nowhere
    # (a forced resume's values are in config.yaml and used: tests/checkpoint/test_run_dir.py)


@pytest.mark.slow  # in-process: tests/checkpoint/test_checkpoint.py, test_fresh_start.py
def test_every_checkpoint_damaged_is_refused_from_the_command_line_leaving_the_run(tmp_path):
    from saferun.checkpoint import list_checkpoints

    run = ["run", *FAST, "hydra.run.dir=stable", "trainer.save_every_n_steps=2", "trainer.keep_last=2"]
    run_dir = tmp_path / "stable"
    saferun(*run, "trainer.max_steps=4", cwd=tmp_path)
    written = (run_dir / "config.yaml").read_text()
    for path in list_checkpoints(run_dir / "checkpoints"):  # every checkpoint damaged
        (path / "state.pt").write_bytes((path / "state.pt").read_bytes()[:1000])
    files = {p: p.read_bytes() for p in (run_dir / "checkpoints").rglob("*") if p.is_file()}
    proc = saferun(*run, "trainer.max_steps=6", "resume=auto", cwd=tmp_path, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "every checkpoint in" in proc.stderr and "step-00000002: " in proc.stderr
    assert "step-00000004: " in proc.stderr and "To start over on purpose" in proc.stderr
    assert {p: p.read_bytes() for p in (run_dir / "checkpoints").rglob("*") if p.is_file()} == files
    assert (run_dir / "config.yaml").read_text() == written
    assert json.loads((run_dir / "summary.json").read_text())["step"] == 4


def test_a_save_that_cannot_be_written_says_which_and_why(tmp_path):
    import resource

    def small_files():  # a checkpoint here is about 290 kB; the other files are smaller
        resource.setrlimit(resource.RLIMIT_FSIZE, (150_000, 150_000))

    proc = subprocess.run([sys.executable, "-m", "saferun", "run", *FAST, "hydra.run.dir=full",
                           "trainer.save_every_n_steps=2"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, preexec_fn=small_files)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "saferun: error: could not write " in proc.stderr
    assert "checkpoints/step-00000002: File too large" in proc.stderr
    assert "RLIMIT_FSIZE) is 150000 bytes" in proc.stderr
    assert "keep_last=K needs room for K+1 checkpoints" in proc.stderr
    assert "enforce fail" not in proc.stderr
    assert not list((tmp_path / "full" / "checkpoints").iterdir())  # no partial files left


def earlier_run(run_dir):
    """An earlier run's files in `run_dir`: checkpoints, metrics.jsonl, config.yaml, model.pt
    (a toy run in this process) and its text log; returns them with their bytes."""
    from toys import ToyTrainer, toy_config

    cfg = toy_config(run_dir.parent, run_dir=str(run_dir), max_steps=2, log_every_n_steps=1)
    cfg["logger"] = {"jsonl": {"_target_": "saferun.loggers.MetricsJsonl"}}
    ToyTrainer(cfg).fit()
    (run_dir / "saferun.log").write_text("[a line of the earlier run]\n")
    (run_dir / ".hydra").mkdir()  # as the command line writes it: the earlier run's overrides
    (run_dir / ".hydra" / "overrides.yaml").write_text("- seed=1\n")
    return {p.relative_to(run_dir).as_posix(): p.read_bytes() for p in run_dir.rglob("*")
            if p.is_file() and p.name != ".saferun.lock"}


def test_resume_fresh_sets_the_earlier_run_and_its_text_log_aside_and_logger_jsonl_null_drops_one(tmp_path):
    earlier = earlier_run(tmp_path / "exp")
    saferun("run", *FAST, "hydra.run.dir=exp", "resume=fresh", "logger.jsonl=null",
            "trainer.max_steps=2", cwd=tmp_path)
    run_dir = tmp_path / "exp"
    [aside] = [p for p in run_dir.iterdir() if p.name.startswith("superseded-")]
    assert {p.relative_to(aside).as_posix(): p.read_bytes() for p in aside.rglob("*")
            if p.is_file()} == earlier  # nothing of this run was written into them
    log = (run_dir / "saferun.log").read_text()
    assert "resume=fresh" in log and aside.name in log and "[a line of the earlier run]" not in log
    assert "resume=fresh" in (run_dir / ".hydra" / "overrides.yaml").read_text()  # this run's
    # logger.jsonl=null: the default loggers less metrics.jsonl
    assert not (run_dir / "metrics.jsonl").exists() and (run_dir / "tensorboard").is_dir()
    assert json.loads((run_dir / "summary.json").read_text())["step"] == 2


@pytest.mark.slow  # two Hydra start-ups (8 s); Python: tests/checkpoint/test_fresh_start.py
def test_a_fresh_start_over_another_runs_checkpoints_is_refused_from_the_command_line(tmp_path):
    earlier = earlier_run(tmp_path / "exp")
    # trainer.save_best=val/loss: its inferred direction, like the threads plan, is said only once
    # the run is accepted, so nothing of the refused start reaches the earlier run's saferun.log
    proc = saferun("run", *FAST, "hydra.run.dir=exp", "trainer.save_best=val/loss", cwd=tmp_path,
                   check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "holds the checkpoints of another run" in proc.stderr
    assert "resume=auto" in proc.stderr and "resume=fresh" in proc.stderr
    now = {p.relative_to(tmp_path / "exp").as_posix(): p.read_bytes()
           for p in (tmp_path / "exp").rglob("*") if p.is_file()}
    assert {k: v for k, v in now.items() if k != ".saferun.lock"} == earlier
    # (.hydra/ is written only once a run is accepted: the earlier run's is unchanged above)
    assert (tmp_path / "exp" / ".hydra" / "overrides.yaml").read_text() == "- seed=1\n"
    # logger=jsonl then logger.jsonl=null: the composed set is whole, so no logger at all
    saferun("run", *FAST, "hydra.run.dir=other", "logger=jsonl", "logger.jsonl=null", cwd=tmp_path)
    assert not (tmp_path / "other" / "metrics.jsonl").exists()
    assert not (tmp_path / "other" / "tensorboard").exists()


def test_resume_auto_in_a_run_directory_made_for_this_run_is_refused_naming_the_latest_runs(tmp_path):
    """Without hydra.run.dir each run gets a new directory: resume=auto would start from 0."""
    alone = saferun("run", *FAST, "recipe=tabular", "resume=auto", cwd=tmp_path, check=False)
    assert alone.returncode == 1 and "Traceback" not in alone.stderr
    assert "resume=auto, but hydra.run.dir is not set" in alone.stderr
    assert "No earlier run under runs/tabular left a checkpoint" in alone.stderr
    assert list(tmp_path.iterdir()) == []  # the refused run left nothing
    earlier_run(tmp_path / "runs" / "tabular" / "2026-01-01_00-00-00_abcd")
    proc = saferun("run", *FAST, "recipe=tabular", "resume=auto", cwd=tmp_path, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "runs/tabular/2026-01-01_00-00-00_abcd (step 2)" in proc.stderr
    assert proc.stderr.rstrip().endswith(
        f"To continue the latest: saferun run {' '.join(FAST)} recipe=tabular resume=auto "
        f"hydra.run.dir=runs/tabular/2026-01-01_00-00-00_abcd")
    assert [p.name for p in (tmp_path / "runs" / "tabular").iterdir()] == ["2026-01-01_00-00-00_abcd"]


@pytest.mark.slow  # three runs (15 s)
def test_the_command_a_refused_resume_auto_names_continues_that_run(tmp_path):
    run = ["run", *FAST, "recipe=tabular", "sched.total_steps=100", "trainer.save_every_n_steps=5"]
    saferun(*run, cwd=tmp_path)
    [earlier] = (tmp_path / "runs" / "tabular").iterdir()
    refused = saferun(*run, "trainer.max_steps=15", "resume=auto", cwd=tmp_path, check=False)
    command = refused.stderr.rstrip().rsplit("To continue the latest: ", 1)[1].split()
    assert command[-1] == f"hydra.run.dir=runs/tabular/{earlier.name}"
    proc = saferun(*command[1:], cwd=tmp_path)
    assert "Resumed from" in proc.stdout + proc.stderr
    assert json.loads((earlier / "summary.json").read_text())["step"] == 15
    assert [p.name for p in (tmp_path / "runs" / "tabular").iterdir()] == [earlier.name]
