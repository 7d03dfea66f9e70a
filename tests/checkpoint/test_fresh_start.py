"""A run starting from step 0 never mixes with an earlier run in its run directory
(saferun/checkpoint/superseded.py): over that run's checkpoints it is refused unless
resume=fresh, which moves the earlier run's checkpoints and logs aside; a fresh start under
resume=auto (nothing to resume) moves an earlier attempt's logs aside."""

import json
import logging
import shutil
import subprocess

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import saferun
from saferun.checkpoint import list_checkpoints
from saferun.checkpoint.superseded import note_log_files
from toys import ToyTrainer, toy_config
from helpers import superseded

JSONL = {"jsonl": {"_target_": "saferun.loggers.MetricsJsonl"}}


def config(tmp_path, resume=None, tensorboard=False, **trainer):
    settings = {"max_steps": 6, "save_every_n_steps": 2, "log_every_n_steps": 1, **trainer}
    cfg = toy_config(tmp_path, tensorboard=tensorboard, **settings)
    cfg["logger"] = {**cfg["logger"], **JSONL}
    cfg["resume"] = resume
    return cfg


def files(path):
    """Every file under `path` with its bytes (but the lock, which names the last holder)."""
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*")
            if p.is_file() and p.name != ".saferun.lock"}


def train_steps(run_dir):
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x["step"] for x in lines if x["kind"] == "train"]


def whole_state(trainer):
    """Parameters and buffers, and the optimizer's state."""
    state = {f"model.{k}": v.clone() for k, v in trainer.model.state_dict().items()}
    for i, s in trainer.optimizer.state_dict()["state"].items():
        state.update({f"optim.{i}.{k}": torch.as_tensor(v).clone() for k, v in s.items()})
    return state


def test_a_fresh_start_over_another_runs_checkpoints_is_refused_before_anything_is_written(tmp_path):
    ToyTrainer(config(tmp_path)).fit()
    run_dir = tmp_path / "run"
    before = files(run_dir)
    with pytest.raises(saferun.SaferunError, match=r"holds the checkpoints of another run \(the "
                       r"latest: step 6, .*step-00000006\).*resume=auto.*resume=fresh"):
        ToyTrainer(config(tmp_path, max_steps=2)).fit()
    assert files(run_dir) == before


def test_resume_fresh_sets_the_earlier_run_aside_and_resume_auto_continues_the_new_one(tmp_path, caplog):
    ToyTrainer(config(tmp_path)).fit()  # the earlier run: checkpoints up to step 6
    run_dir = tmp_path / "run"
    earlier = files(run_dir)
    again = ToyTrainer(config(tmp_path, resume="fresh", max_steps=2))
    with caplog.at_level(logging.WARNING, logger="saferun"):
        again.fit()
    [aside] = superseded(run_dir)
    assert files(aside) == earlier  # checkpoints, logs, config.yaml, model.pt: all, unchanged
    assert "resume=fresh" in caplog.text and str(aside) in caplog.text
    assert train_steps(run_dir) == [1, 2]
    # nothing of the earlier run was loaded: the same as a start in an empty directory
    clean = ToyTrainer(config(tmp_path / "clean", max_steps=2))
    clean.fit()
    mine, want = whole_state(again), whole_state(clean)
    assert list(mine) == list(want) and all(torch.equal(mine[k], want[k]) for k in want)
    # resume=auto continues this run from its step 2, not the earlier run's step 6
    ToyTrainer(config(tmp_path, resume="auto", max_steps=4)).fit()
    assert train_steps(run_dir) == [1, 2, 3, 4]
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == [
        "step-00000002", "step-00000004"]


class CrashesAtStep3(ToyTrainer):
    def training_step(self, batch):
        if self.state.step == 2:
            raise RuntimeError("planted crash in step 3")
        return super().training_step(batch)


def test_a_fresh_start_under_resume_auto_sets_an_earlier_attempts_logs_aside(tmp_path):
    cfg = config(tmp_path, resume="auto", tensorboard=True, save_every_n_steps=None)
    with pytest.raises(Exception, match="planted crash"):
        CrashesAtStep3(cfg).fit()  # before any checkpoint: steps 1 and 2 logged
    run_dir = tmp_path / "run"
    ToyTrainer(cfg).fit()  # resume=auto: nothing to resume, a fresh start
    [aside] = superseded(run_dir)
    assert train_steps(aside) == [1, 2] and (aside / "tensorboard").is_dir()
    assert train_steps(run_dir) == [1, 2, 3, 4, 5, 6]  # this attempt alone, each step once
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]


def test_resume_auto_over_damaged_checkpoints_is_refused_and_resume_fresh_sets_them_aside(tmp_path):
    ToyTrainer(config(tmp_path, max_steps=2)).fit()
    root = tmp_path / "run" / "checkpoints"
    for path in list_checkpoints(root):
        (path / "state.pt").write_bytes(b"damaged")
    with pytest.raises(saferun.SaferunError, match="(?s)every checkpoint .* damaged.*set resume=fresh"):
        ToyTrainer(config(tmp_path, resume="auto", max_steps=2)).fit()
    ToyTrainer(config(tmp_path, resume="fresh", max_steps=2)).fit()
    [aside] = superseded(tmp_path / "run")
    assert (aside / "checkpoints" / "step-00000002" / "state.pt").read_bytes() == b"damaged"
    assert [p.name for p in list_checkpoints(root)] == ["step-00000002"]


@pytest.fixture
def immutable():
    """chattr +i: a file even root cannot rename; undone after the test."""
    marked = []

    def mark(path):
        if shutil.which("chattr") is None or subprocess.run(
                ["chattr", "+i", str(path)], capture_output=True).returncode != 0:
            pytest.skip("chattr +i is not available here")
        marked.append(path)

    yield mark
    for path in marked:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def test_earlier_files_that_cannot_be_moved_stop_the_run_and_stay_where_they_were(tmp_path, immutable):
    cfg = config(tmp_path, resume="auto", save_every_n_steps=None)
    with pytest.raises(Exception, match="planted crash"):
        CrashesAtStep3(cfg).fit()
    run_dir = tmp_path / "run"
    before = files(run_dir)
    immutable(run_dir / "config.yaml")  # moved after metrics.jsonl: that move is undone
    with pytest.raises(saferun.SaferunError, match="could not move the earlier run's files .* "
                       "aside .*nothing of this run was written"):
        ToyTrainer(cfg).fit()
    assert files(run_dir) == before and not superseded(run_dir)


def test_this_runs_first_log_lines_stay_with_it_when_an_earlier_text_log_is_set_aside(tmp_path, caplog):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "saferun.log").write_text("[a line of the earlier attempt]\n")
    handler = logging.FileHandler(run_dir / "saferun.log")  # appending, as Hydra's job log does
    logging.getLogger().addHandler(handler)
    caplog.set_level(logging.INFO, logger="saferun")
    try:
        note_log_files()  # what `saferun run` does first
        ToyTrainer(config(tmp_path, resume="auto", max_steps=2)).fit()
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    [aside] = superseded(run_dir)
    assert (aside / "saferun.log").read_text() == "[a line of the earlier attempt]\n"
    log = (run_dir / "saferun.log").read_text()  # setup's line, logged before the move, too
    assert log.index("resume=auto: no checkpoint") < log.index(f"moved to {aside}")


@pytest.mark.parametrize("entry", ["validate", "predict"])
def test_evaluating_alone_over_a_runs_checkpoints_with_resume_unset_says_what_it_evaluates(
        tmp_path, caplog, entry):
    trained = ToyTrainer(config(tmp_path, max_steps=2))
    trained.fit()

    def evaluate(resume):
        t = ToyTrainer(config(tmp_path, resume=resume, max_steps=2))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="saferun"):
            out = t.validate() if entry == "validate" else t.predict(torch.randn(4, 8))
        return t, out, caplog.text

    t, _, said = evaluate(None)  # the model as built, silently before: now said, with the fix
    assert f"{entry}(): resume is unset" in said and "(the latest: step 2)" in said
    assert "resume=auto" in said
    assert not torch.equal(t.model.head.weight, trained.model.head.weight)
    t, _, said = evaluate("auto")  # the checkpoint's weights: nothing to say
    assert "resume is unset" not in said
    assert torch.equal(t.model.head.weight, trained.model.head.weight)


def test_an_unexpected_failure_while_clearing_is_the_verdict_every_rank_gets(tmp_path, monkeypatch):
    # rank 0 broadcasts whatever stopped it (under torchrun the other ranks raise the same
    # error instead of waiting for a verdict that never comes); here, one process
    from saferun.checkpoint import superseded

    def broken(path, resume, owned):
        raise KeyError("planted")

    monkeypatch.setattr(superseded, "_clear", broken)
    with pytest.raises(saferun.SaferunError, match="checking the run directory .* failed: KeyError") as e:
        superseded.start_fresh(str(tmp_path), None, main=True)
    assert isinstance(e.value.__cause__, KeyError)
    superseded.start_fresh(str(tmp_path), None, main=False)  # a rank that only listens: verdict None
