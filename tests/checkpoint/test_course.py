"""Changing course with resume=PATH (saferun/checkpoint/course.py): the superseded course's
checkpoints and logs go aside whole, the continued course's logs run on from PATH's, and a
run killed at any point of the change is finished by a later resume=auto."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import saferun
from saferun.checkpoint import list_checkpoints, load_checkpoint
from saferun.checkpoint.course import RECORD
from saferun.checkpoint.intent import INTENT
from toys import TENSORBOARD, TOYS_PATH, ToyTrainer, toy_config
from helpers import assert_equal_nested, superseded


def config(run_dir, steps, resume=None, lr=0.05):
    cfg = toy_config(run_dir.parent, max_steps=steps, save_every_n_steps=2, keep_last=10,
                     log_every_n_steps=1, val_every_n_steps=2)
    cfg["trainer"]["run_dir"] = str(run_dir)
    cfg["logger"] = {**TENSORBOARD, "jsonl": {"_target_": "saferun.loggers.MetricsJsonl"}}
    cfg["optim"]["lr"] = lr
    if resume is not None:  # a lower learning rate from an older checkpoint: force_resume
        cfg["resume"], cfg["force_resume"] = str(resume), True
    return cfg


def files(path):
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*")
            if p.is_file() and p.name != ".saferun.lock" and "superseded-" not in p.relative_to(path).as_posix()}


def jsonl(data):
    return [json.loads(line) for line in data.decode().splitlines()]  # each line parses


def untimed(records):
    return [{k: v for k, v in r.items() if k != "time" and not k.startswith("perf/")} for r in records]


def scalars(log_dir):
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["scalars"] if not tag.startswith("perf/")}


def whole_state(checkpoint):
    state = load_checkpoint(checkpoint)
    for key in ("config", "provenance", "callbacks"):  # paths and timings differ by design
        state.pop(key)
    state["loop"]["metrics"] = {k: v for k, v in state["loop"]["metrics"].items() if not k.startswith("perf/")}
    return state


def assert_same(a, b, path=""):
    assert_equal_nested(b, a, path)


@pytest.mark.slow  # four runs; one process: the tests below
def test_resume_path_sets_the_superseded_course_aside_and_its_logs_run_on_from_path(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    ToyTrainer(config(a, 8)).fit()  # the first course, to step 8
    first = files(a)
    ToyTrainer(config(b, 6, lr=0.3)).fit()  # b: an earlier run of its own
    earlier_b = files(b)
    step4 = a / "checkpoints" / "step-00000004"
    ToyTrainer(config(b, 8, resume=step4, lr=0.01)).fit()  # PATH in another run directory
    ToyTrainer(config(a, 8, resume=step4, lr=0.01)).fit()  # an older checkpoint of this one

    # every file of what was superseded is set aside as it was, nothing deleted or mixed
    [aside_b], [aside_a] = superseded(b), superseded(a)
    assert files(aside_b) == earlier_b
    kept = ("checkpoints/step-00000002/", "checkpoints/step-00000004/")
    assert files(aside_a) == {k: v for k, v in first.items() if not k.startswith(kept)}
    assert (aside_a / "tensorboard").is_dir() and list((aside_a / "tensorboard").glob("*.hparams"))
    assert [p.name for p in list_checkpoints(a / "checkpoints")] == [
        "step-00000002", "step-00000004", "step-00000006", "step-00000008"]
    assert [p.name for p in list_checkpoints(b / "checkpoints")] == [
        "step-00000004", "step-00000006", "step-00000008"]  # step 4: this directory's own copy
    assert not (a / RECORD).exists() and not (b / RECORD).exists()

    # metrics.jsonl: the first course up to step 4 (its very lines), then the new course
    original = jsonl(first["metrics.jsonl"])
    upto = sum(r["step"] <= 4 for r in original)
    logged = {run: jsonl((run / "metrics.jsonl").read_bytes()) for run in (a, b)}
    for run, records in logged.items():
        assert records[:upto] == original[:upto], run
        assert [(r["kind"], r["step"]) for r in records] == [(r["kind"], r["step"]) for r in original]
        assert untimed(records[upto:]) != untimed(original[upto:])  # another learning rate
    assert untimed(logged[a]) == untimed(logged[b])  # one course, the same in both directories
    # TensorBoard: the same curves, each step once, the first course's up to step 4
    old, curves = scalars(aside_a / "tensorboard"), {run: scalars(run / "tensorboard") for run in (a, b)}
    assert curves[a] == curves[b]
    for tag, points in curves[a].items():
        steps = [s for s, _ in points]
        assert steps == sorted(set(steps)), tag
        assert [p for p in points if p[0] <= 4] == [p for p in old[tag] if p[0] <= 4], tag
    assert len(list((a / "tensorboard").glob("*.hparams"))) == 1  # the new course's entry alone
    assert_same(whole_state(a / "checkpoints" / "step-00000008"),
                whole_state(b / "checkpoints" / "step-00000008"))
    assert torch.load(a / "model.pt", weights_only=True).keys() == first_keys(first)


def first_keys(files_before):
    import io

    return torch.load(io.BytesIO(files_before["model.pt"]), weights_only=True).keys()


# ---------------------------------------------------------------- killed while changing course

# before the change's record: the intent written (intent.py), the model built; then the
# renames of a change to step 4 of a course at step 8 (see course.py's record): the
# checkpoints of steps 6 and 8, then tensorboard/, metrics.jsonl, config.yaml, model.pt
KILL_POINTS = ["course-startup", "course-built", "course-intent",
               *(f"course-rename-{n}" for n in range(1, 7)), "course-copied"]


@pytest.fixture(scope="module")
def first_course(tmp_path_factory):
    """A first course to step 8, and the change of course to its step 4, uninterrupted."""
    base = tmp_path_factory.mktemp("course")
    ToyTrainer(config(base / "first", 8)).fit()
    shutil.copytree(base / "first", base / "changed")
    ToyTrainer(config(base / "changed", 8, resume=base / "changed" / "checkpoints" / "step-00000004",
                      lr=0.01)).fit()
    return base / "first", base / "changed"


def killed_then_auto(first, run_dir, point, resume):
    """Change course in `run_dir` in a process killed with SIGKILL at `point`, then resume=auto."""
    proc = subprocess.run([sys.executable, TOYS_PATH, json.dumps(config(run_dir, 8, resume=resume, lr=0.01))],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "SAFERUN_KILL_AT": point})
    assert proc.returncode == -9, proc.stdout + proc.stderr  # killed there, not finished
    assert (run_dir / RECORD).is_file() or (run_dir / INTENT).is_file()
    again = config(run_dir, 8, lr=0.01)
    again["resume"], again["force_resume"] = "auto", True
    ToyTrainer(again).fit()
    assert not (run_dir / RECORD).exists() and not (run_dir / INTENT).exists()


def assert_as_if_not_killed(run_dir, changed, first):
    [aside] = superseded(run_dir)
    kept = ("checkpoints/step-00000002/", "checkpoints/step-00000004/")
    assert files(aside) == {k: v for k, v in files(first).items() if not k.startswith(kept)}
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == \
        [p.name for p in list_checkpoints(changed / "checkpoints")]
    for done in list_checkpoints(changed / "checkpoints"):
        assert_same(whole_state(run_dir / "checkpoints" / done.name), whole_state(done))
    assert untimed(jsonl((run_dir / "metrics.jsonl").read_bytes())) == \
        untimed(jsonl((changed / "metrics.jsonl").read_bytes()))
    assert scalars(run_dir / "tensorboard") == scalars(changed / "tensorboard")


def kill_case(first_course, tmp_path, point):
    first, changed = first_course
    run_dir = tmp_path / "run"
    shutil.copytree(first, run_dir)
    killed_then_auto(first, run_dir, point, run_dir / "checkpoints" / "step-00000004")
    assert_as_if_not_killed(run_dir, changed, first)


class Killed(BaseException):
    pass


def test_a_change_of_course_stopped_between_two_renames_is_finished_by_resume_auto(
        first_course, tmp_path, monkeypatch):
    # in this process (the real SIGKILLs are the slow tests below): stopped once the checkpoint
    # of step 6 is aside and that of step 8 is still here, resume=auto must not continue the
    # old course from step 8, but finish the change and continue from step 4
    from saferun.checkpoint import course

    first, changed = first_course
    run_dir = tmp_path / "run"
    shutil.copytree(first, run_dir)

    def kill_point(name):
        if name == "course-rename-1":
            raise Killed
    monkeypatch.setattr(course, "_kill_point", kill_point)
    with pytest.raises(Killed):
        ToyTrainer(config(run_dir, 8, resume=run_dir / "checkpoints" / "step-00000004", lr=0.01)).fit()
    assert (run_dir / RECORD).is_file() and (run_dir / "checkpoints" / "step-00000008").is_dir()
    monkeypatch.undo()
    for other in (None, "fresh"):  # half moved: no other start until the change is finished
        cfg = config(run_dir, 8, lr=0.01)
        cfg["resume"] = other
        with pytest.raises(saferun.SaferunError, match="unfinished change of course.*resume=auto"):
            ToyTrainer(cfg).fit()
    again = config(run_dir, 8, lr=0.01)
    again["resume"], again["force_resume"] = "auto", True
    ToyTrainer(again).fit()
    assert not (run_dir / RECORD).exists()
    assert_as_if_not_killed(run_dir, changed, first)


class DiesInBuild(ToyTrainer):
    """Killed while the model is built: before the change of course is recorded."""

    def build_model(self):
        raise Killed


class DiesInStep(ToyTrainer):
    """Killed in its first training step."""

    def training_step(self, batch):
        raise Killed


def test_a_change_of_course_killed_before_its_record_is_made_by_resume_auto(first_course, tmp_path):
    # the start-up (imports, the model, the data, the checkpoint read) comes before the
    # change's record: killed there, resume=auto continued the old course from step 8 and
    # exited 0. The intent, written when the Trainer is made, has resume=auto make the change.
    first, changed = first_course
    run_dir = tmp_path / "run"
    shutil.copytree(first, run_dir)
    with pytest.raises(Killed):
        DiesInBuild(config(run_dir, 8, resume=run_dir / "checkpoints" / "step-00000004", lr=0.01)).fit()
    assert files(run_dir) == {**files(first), INTENT: (run_dir / INTENT).read_bytes()}
    again = config(run_dir, 8, lr=0.01)
    again["resume"], again["force_resume"] = "auto", True
    ToyTrainer(again).fit()
    assert not (run_dir / INTENT).exists() and not (run_dir / RECORD).exists()
    assert_as_if_not_killed(run_dir, changed, first)


def test_an_intent_goes_with_a_refusal_an_evaluation_or_another_start(first_course, tmp_path):
    # a refused resume=PATH changed nothing: its intent goes too (resume=auto then continues
    # the course that is there); so does the intent of an evaluation, and a start that
    # replaces it (resume=fresh); a killed run's intent that names no checkpoint is refused
    first, _ = first_course
    run_dir = tmp_path / "run"
    shutil.copytree(first, run_dir)
    before = files(run_dir)
    refused = config(run_dir, 8, resume=run_dir / "checkpoints" / "step-00000004", lr=0.01)
    refused["force_resume"] = False  # a new learning rate needs it
    with pytest.raises(saferun.ConfigError, match="force_resume"):
        ToyTrainer(refused).fit()
    assert files(run_dir) == before
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(saferun.SaferunError, match="holds no complete checkpoint"):
        ToyTrainer(config(run_dir, 8, resume=empty)).fit()  # refused as the model is built
    assert files(run_dir) == before
    evaluating = ToyTrainer(config(run_dir, 8, resume=run_dir / "checkpoints" / "step-00000004"))
    evaluating.validate()
    assert files(run_dir) == before
    (run_dir / INTENT).write_text(json.dumps({"resume": str(tmp_path / "gone")}))
    auto = config(run_dir, 8)
    auto["resume"] = "auto"
    with pytest.raises(saferun.SaferunError, match=f"holds the intent of a change of course to "
                                                   f"{tmp_path / 'gone'}.*Delete {INTENT}"):
        ToyTrainer(auto).fit()
    (run_dir / INTENT).write_text("{")
    with pytest.raises(saferun.SaferunError, match=f"{INTENT} .* is unreadable"):
        ToyTrainer(auto).fit()
    fresh = config(run_dir, 2)
    fresh["resume"] = "fresh"
    ToyTrainer(fresh).fit()
    assert not (run_dir / INTENT).exists()
    # resume=PATH naming the newest checkpoint: nothing supersedes, the intent is done at once
    # (killed later, resume=auto must continue, not go back to PATH)
    with pytest.raises(Killed):
        DiesInStep(config(run_dir, 4, resume=run_dir / "checkpoints" / "step-00000002")).fit()
    assert not (run_dir / INTENT).exists() and not superseded(run_dir)[1:]


def test_carrying_out_a_change_twice_moves_each_entry_once(first_course, tmp_path):
    # a run killed after the moves and copies: the next one carries the record out again
    from saferun.checkpoint import course

    first, changed = first_course
    run_dir = tmp_path / "run"
    shutil.copytree(first, run_dir)
    step4 = run_dir / "checkpoints" / "step-00000004"
    record = course.change_course(str(run_dir), step4, 4, main=True)
    once = files(run_dir), files(run_dir / record["aside"])
    (run_dir / ".tmp-tensorboard-dead").mkdir()  # a pass killed while copying the events
    (run_dir / ".tmp-tensorboard-dead" / "events.out.tfevents.0.x").write_bytes(b"half")
    assert course.change_course(str(run_dir), step4, 4, main=True) == record
    assert not (run_dir / ".tmp-tensorboard-dead").exists()
    assert (files(run_dir), files(run_dir / record["aside"])) == once
    kept = ("checkpoints/step-00000002/", "checkpoints/step-00000004/")
    assert once[1] == {k: v for k, v in files(first).items() if not k.startswith(kept)}
    # the continued course's past: the first course's lines and events up to step 4 alone
    assert jsonl(once[0]["metrics.jsonl"]) == [r for r in jsonl(files(first)["metrics.jsonl"])
                                                if r["step"] <= 4]
    old = scalars(first / "tensorboard")
    assert scalars(run_dir / "tensorboard") == {
        tag: [p for p in points if p[0] <= 4] for tag, points in old.items()}
    assert not list((run_dir / "tensorboard").glob("*.hparams"))  # the new course writes its own


def test_another_run_directorys_checkpoint_sets_this_ones_earlier_run_aside_and_continues_paths_logs(
        first_course, tmp_path):
    # run directory b holds an earlier run; resume=<a's step 4>: b's metrics.jsonl is never
    # cut to a's recorded length: b's run goes aside whole, b continues a's course
    first, changed = first_course
    b = tmp_path / "b"
    ToyTrainer(config(b, 6, lr=0.3)).fit()
    earlier = files(b)
    ToyTrainer(config(b, 8, resume=first / "checkpoints" / "step-00000004", lr=0.01)).fit()
    [aside] = superseded(b)
    assert files(aside) == earlier
    logged, original = jsonl((b / "metrics.jsonl").read_bytes()), jsonl((first / "metrics.jsonl").read_bytes())
    upto = sum(r["step"] <= 4 for r in original)
    assert logged[:upto] == original[:upto] and all(r["step"] > 4 for r in logged[upto:])
    assert untimed(logged) == untimed(jsonl((changed / "metrics.jsonl").read_bytes()))
    curves, old = scalars(b / "tensorboard"), scalars(first / "tensorboard")
    assert curves == scalars(changed / "tensorboard")
    assert {tag: [p for p in points if p[0] <= 4] for tag, points in curves.items()} == \
        {tag: [p for p in points if p[0] <= 4] for tag, points in old.items()}
    for done in list_checkpoints(changed / "checkpoints")[2:]:  # steps 6 and 8
        assert_same(whole_state(b / "checkpoints" / done.name), whole_state(done))
    # b's own copy of step 4 is this course's: a resume from it keeps the new learning rate
    own = whole_state(b / "checkpoints" / "step-00000004")
    assert own["optimizer"]["param_groups"][0]["lr"] == 0.01
    own["optimizer"]["param_groups"][0]["lr"] = 0.05
    assert_same(own, whole_state(first / "checkpoints" / "step-00000004"))


@pytest.mark.slow  # a process per kill point; one in this process in the default run (above)
@pytest.mark.parametrize("point", KILL_POINTS)
def test_a_change_of_course_killed_at_any_point_is_finished_by_resume_auto(first_course, tmp_path, point):
    kill_case(first_course, tmp_path, point)


@pytest.mark.slow
@pytest.mark.parametrize("point", ["course-intent", "course-rename-1", "course-copied"])
def test_a_change_to_another_run_directorys_checkpoint_killed_is_finished_by_resume_auto(
        first_course, tmp_path, point):
    # before this directory's first checkpoint of the new course, resume=auto must continue
    # from PATH (in the other directory), not start from step 0
    first, changed = first_course
    run_dir = tmp_path / "other"
    ToyTrainer(config(run_dir, 4, lr=0.3)).fit()  # an earlier run of its own
    earlier = files(run_dir)
    killed_then_auto(first, run_dir, point, first / "checkpoints" / "step-00000004")
    [aside] = superseded(run_dir)
    assert files(aside) == earlier
    for done in list_checkpoints(changed / "checkpoints")[2:]:  # steps 6 and 8
        assert_same(whole_state(run_dir / "checkpoints" / done.name), whole_state(done))
    assert untimed(jsonl((run_dir / "metrics.jsonl").read_bytes())) == \
        untimed(jsonl((changed / "metrics.jsonl").read_bytes()))


class PlantedValidation(ToyTrainer):
    """Validation reports the loss planted for each step."""

    losses = {}

    def validation_step(self, batch):
        return {"loss": torch.tensor(self.losses[self.state.step])}


@pytest.mark.parametrize("losses, where, named", [
    # the best (step 2) was deleted by the first course's rotation once step 8 was better
    ({2: 1.0, 4: 2.0, 6: 3.0, 8: 0.5}, "a", ""),
    ({2: 1.0, 4: 2.0, 6: 3.0, 8: 0.5}, "b", ""),
    # PATH itself is the best: in another run directory, this one's own copy of it
    ({2: 3.0, 4: 2.0, 6: 1.0, 8: 0.5}, "b", "b/checkpoints/step-00000006"),
])
def test_after_a_change_of_course_save_best_names_a_checkpoint_of_this_run_directory_or_none(
        tmp_path, losses, where, named, caplog):
    class Trainer(PlantedValidation):
        pass
    Trainer.losses = losses

    def cfg(run_dir, steps, resume=None):
        c = config(run_dir, steps, resume)
        c["trainer"].update(keep_last=2, save_best="val/loss", val_every_n_steps=2)
        return c
    a = tmp_path / "a"
    Trainer(cfg(a, 8)).fit()
    step6 = a / "checkpoints" / "step-00000006"
    best = load_checkpoint(step6)["loop"]["best"]
    assert Path(best[1]).name == ("step-00000002" if losses[2] == 1.0 else "step-00000006")
    Trainer(cfg(tmp_path / where, 6, resume=step6)).fit()  # resumed at step 6, ends there
    saved = load_checkpoint(tmp_path / where / "checkpoints" / "step-00000006")["loop"]["best"]
    assert saved[0] == 1.0  # the course's best so far: a new best must beat it
    assert saved[1] == (str(tmp_path / named) if named else "")
    if not named:
        assert "save_best" in caplog.text and "step-00000002" in caplog.text


@pytest.mark.slow  # two command-line runs; the same change in this process: the tests above
def test_from_the_command_line_the_superseded_course_takes_its_hydra_files_and_text_log_along(tmp_path):
    run = [sys.executable, "-m", "saferun", "run", "debug=fast", "trainer.progress_bar=false",
           "hydra.run.dir=exp", "trainer.max_steps=6", "trainer.save_every_n_steps=2",
           "trainer.keep_last=10"]
    subprocess.run(run, cwd=tmp_path, check=True, capture_output=True, timeout=300)
    exp = tmp_path / "exp"
    before = files(exp)
    assert {".hydra/overrides.yaml", "saferun.log", "summary.json", "model.pt"} <= set(before)
    change = ["resume=exp/checkpoints/step-00000002", "optim.lr=1e-4", "force_resume=true"]
    proc = subprocess.run(run + change, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [aside] = superseded(exp)
    assert files(aside) == {k: v for k, v in before.items() if not k.startswith("checkpoints/step-00000002/")}
    assert "- force_resume=true" in (exp / ".hydra" / "overrides.yaml").read_text()
    log = (exp / "saferun.log").read_text()
    assert "Resumed from exp/checkpoints/step-00000002" in log and log.count("step 2/6") == 0
    assert [r["step"] for r in jsonl((exp / "metrics.jsonl").read_bytes()) if r["kind"] == "train"] == \
        [r["step"] for r in jsonl(before["metrics.jsonl"]) if r["kind"] == "train"]


@pytest.mark.slow  # four command-line runs; the same kill in this process: the tests above
@pytest.mark.parametrize("run_dir", [
    "exp",  # given: the intent is written before Hydra composes the config
    "${oc.env:SAFERUN_TEST_RUN_DIR}",  # known once Hydra composed the config: written then
])
def test_from_the_command_line_a_change_killed_in_its_start_up_is_made_by_resume_auto(tmp_path, run_dir):
    # killed as the command line starts, resume=auto with the same overrides ends as the
    # change made uninterrupted, not as the old course
    # (one thread: auto plans from the cores free at each start, and sums over 1 or 2 threads
    # round differently: compared bit for bit, a busy machine made the courses differ)
    run = [sys.executable, "-m", "saferun", "run", "debug=fast", "trainer.progress_bar=false",
           "trainer.max_steps=6", "trainer.save_every_n_steps=2", "trainer.keep_last=10",
           "trainer.num_threads=1"]
    subprocess.run(run + ["hydra.run.dir=exp"], cwd=tmp_path, check=True, capture_output=True, timeout=300)
    shutil.copytree(tmp_path / "exp", tmp_path / "ref")
    change = ["optim.lr=1e-4", "force_resume=true"]
    subprocess.run(run + change + ["hydra.run.dir=ref", "resume=ref/checkpoints/step-00000002"],
                   cwd=tmp_path, check=True, capture_output=True, timeout=300)
    killed = subprocess.run(
        [sys.executable, "-X", "importtime", *run[1:], *change, f"hydra.run.dir={run_dir}",
         "resume=exp/checkpoints/step-00000002"], cwd=tmp_path, capture_output=True, text=True,
        timeout=300, env={**os.environ, "SAFERUN_KILL_AT": "course-startup",
                          "SAFERUN_TEST_RUN_DIR": str(tmp_path / "exp")})
    exp = tmp_path / "exp"
    assert killed.returncode == -9, killed.stdout + killed.stderr
    imported = [line.rsplit("|", 1)[-1].strip() for line in killed.stderr.splitlines()]
    assert "torch" not in imported  # either way the change is durable before torch is imported
    assert "saferun: run directory" not in killed.stdout  # before the config is even loaded
    assert (exp / INTENT).is_file() and not (exp / RECORD).exists()
    again = subprocess.run(run + change + ["hydra.run.dir=exp", "resume=auto"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert not (exp / INTENT).exists() and not (exp / RECORD).exists()
    ref = tmp_path / "ref"
    assert [p.name for p in list_checkpoints(exp / "checkpoints")] == \
        [p.name for p in list_checkpoints(ref / "checkpoints")]
    for done in list_checkpoints(ref / "checkpoints"):
        assert_same(whole_state(exp / "checkpoints" / done.name), whole_state(done))
    assert untimed(jsonl((exp / "metrics.jsonl").read_bytes())) == \
        untimed(jsonl((ref / "metrics.jsonl").read_bytes()))
    assert len(superseded(exp)) == 1


@pytest.mark.slow  # a command-line run per refusal
@pytest.mark.parametrize("wrong, said", [
    ("trainer.max_step=3", "trainer.max_steps"),  # refused before Hydra composes the config
    ("trainer.max_steps=many", "trainer.max_steps"),  # refused as Hydra composes it
    ("trainer.save_best=val/score", "trainer.save_best_mode=max"),  # as saferun loads it
])
def test_from_the_command_line_a_refused_change_leaves_no_intent(first_course, tmp_path, wrong, said):
    first, _ = first_course
    run_dir = tmp_path / "run"
    shutil.copytree(first, run_dir)
    before = files(run_dir)
    refused = subprocess.run(
        [sys.executable, "-m", "saferun", "run", "debug=fast", f"hydra.run.dir={run_dir}",
         f"resume={run_dir / 'checkpoints' / 'step-00000004'}", wrong],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 1 and said in refused.stderr, refused.stderr
    assert {k: v for k, v in files(run_dir).items() if k != "saferun.log"} == \
        {k: v for k, v in before.items() if k != "saferun.log"}
