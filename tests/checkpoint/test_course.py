"""Changing course with resume=PATH (saferun/checkpoint/course.py): the superseded course's
checkpoints and logs go aside whole, the continued course's logs run on from PATH's, and a
run killed at any point of the change is finished by a later resume=auto."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from saferun.checkpoint import list_checkpoints, load_checkpoint
from saferun.checkpoint.course import RECORD
from toys import TENSORBOARD, TOYS_PATH, ToyTrainer, toy_config


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


def superseded(run_dir):
    return [p for p in run_dir.iterdir() if p.name.startswith("superseded-")]


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
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


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

# the renames of a change to step 4 of a course at step 8 (see course.py's record): the
# checkpoints of steps 6 and 8, then tensorboard/, metrics.jsonl, config.yaml, model.pt
KILL_POINTS = ["course-intent", *(f"course-rename-{n}" for n in range(1, 7)), "course-copied"]


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
    assert (run_dir / RECORD).is_file()
    again = config(run_dir, 8, lr=0.01)
    again["resume"], again["force_resume"] = "auto", True
    ToyTrainer(again).fit()
    assert not (run_dir / RECORD).exists()


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


def test_a_change_of_course_killed_between_two_renames_is_finished_by_resume_auto(first_course, tmp_path):
    # the checkpoint of step 6 is aside, that of step 8 still here: resume=auto must not
    # continue the old course from it
    kill_case(first_course, tmp_path, "course-rename-1")


@pytest.mark.slow  # a process per kill point; one in the default run (above)
@pytest.mark.parametrize("point", [p for p in KILL_POINTS if p != "course-rename-1"])
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
