"""The lifecycle grid (grid.py): one test per cell, each reading the shared run of its event."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

import readback as rb
from grid import KIND, PLATEAU_EVENTS, WANDB_KILLED, cells, known, DEFAULT
from grid_job import LOG_EVERY
from runs import COURSE_FROM, Outcome, Runs, flush_wandb
from saferun.errors import NonFiniteError, SaferunError

LOG_ROWS = ("metrics.jsonl", "tensorboard scalars", "tensorboard media", "mlflow", "mlflow media",
            "wandb")


def params() -> list[Any]:
    out = []
    for row, event in cells():
        marks = [] if (row, event) in DEFAULT else [pytest.mark.slow]
        bug = known(row, event)
        if bug is not None:
            reason = bug.what if bug.item is None else f"issue 31 item {bug.item}: {bug.what}"
            marks.append(pytest.mark.xfail(strict=True, reason=reason))
        out.append(pytest.param(row, event, marks=marks, id=f"{row}|{event}"))
    return out


# ------------------------------------------------------------------ what a row holds

def mlflow_view(run_dir: Path) -> dict[str, Any]:
    """The course's MLflow history: its newest run's, after the steps of the run it is linked
    to (a course change may start a run that holds only its own steps)."""
    found = rb.mlflow_runs(run_dir)
    assert found, f"no MLflow run for {run_dir}"
    run = found[-1]
    series = rb.mlflow_series(run_dir, run)
    parent = run.data.tags.get("mlflow.parentRunId")
    if parent is not None and min((s for v in series.values() for s, _ in v), default=0) > COURSE_FROM:
        old = rb.mlflow_client(run_dir.parent).get_run(parent)
        before = rb.mlflow_series(Path(old.data.tags["saferun.run_dir"]), old)
        series = {k: [p for p in before.get(k, []) if p[0] <= COURSE_FROM] + series.get(k, [])
                  for k in set(before) | set(series)}
    return series


def wandb_view(run_dir: Path, old: Optional[Path] = None) -> dict[str, Any]:
    """The course's W&B history: its newest run's; a new course's run that holds only its
    own steps follows the old course's steps up to the course's checkpoint."""
    found = rb.wandb_runs(run_dir)
    assert found, f"no W&B run under {run_dir}/wandb"
    series = rb.wandb_series(found[list(found)[-1]])
    first = min((s for v in series.values() for s, _ in v), default=0)
    if old is not None and first > COURSE_FROM:
        before = rb.wandb_series(next(iter(rb.wandb_runs(old).values())))
        series = {k: [p for p in before.get(k, []) if p[0] <= COURSE_FROM] + series.get(k, [])
                  for k in set(before) | set(series)}
    return series


def view(row: str, run_dir: Path) -> Any:
    """What `row` holds in `run_dir`, as comparable data."""
    if row == "metrics.jsonl":
        return rb.jsonl(run_dir)
    if row == "tensorboard scalars":
        return rb.tensorboard(run_dir)[0]
    if row == "tensorboard media":
        return rb.tensorboard(run_dir)[1]
    if row == "mlflow":
        return mlflow_view(run_dir)
    if row == "mlflow media":
        return rb.mlflow_media(rb.mlflow_runs(run_dir)[-1])
    if row == "wandb":
        return wandb_view(run_dir)
    state = rb.final_checkpoint(run_dir)
    assert state is not None, f"no checkpoint in {run_dir}"
    if row == "best":
        best = state["loop"]["best"]
        return {"value": best[0], "step": best[2], "model_best.pt": rb.weights(run_dir / "model_best.pt")}
    if row == "early stopping":
        return rb.callback_state(state, "EarlyStopping")
    if row in ("scheduler", "plateau"):
        return {"scheduler": state["scheduler"], "lr": rb.jsonl(run_dir).get("train/lr"),
                "param_groups": [g["lr"] for g in state["optimizer"]["param_groups"]]}
    if row == "ema":
        return {"checkpoint": state["ema"], "model_ema.pt": rb.weights(run_dir / "model_ema.pt")}
    if row == "spikes":  # each rank's detectors: [{"loss": state, "grad_norm": state}]
        return [r["spikes"] for r in state["per_rank"]]
    if row == "checkpoint":
        loop = state["loop"]
        return {"model": state["model"], "optimizer": state["optimizer"], "scaler": state["scaler"],
                "loop": {"step": loop["step"], "epoch": loop["epoch"],
                         "batches_in_epoch": loop["batches_in_epoch"],
                         "metrics": {k: v for k, v in loop["metrics"].items() if not k.startswith("perf/")}}}
    raise AssertionError(f"no view for row {row!r}")


def differences(got: Any, want: Any, path: str = "", rel: float = 0.0) -> list[str]:
    """Where `got` and `want` differ: tensors and floats exactly (NaN equals NaN), or within
    `rel` (two ranks sum in halves); containers key by key, in any key order."""
    if isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor):
        same = got.dtype == want.dtype and got.shape == want.shape and (
            torch.allclose(got, want, rel, 1e-6 if rel else 0.0, equal_nan=True)
            if want.is_floating_point() else torch.equal(got, want))
        return [] if same else [f"{path}: {rb.tensor_difference(got, want)}"]
    if isinstance(want, float) and isinstance(got, float):
        same = got == want or (math.isnan(got) and math.isnan(want)) or \
            bool(rel) and math.isclose(got, want, rel_tol=rel, abs_tol=1e-6)
        return [] if same else [f"{path}: {got!r} != {want!r} (the reference)"]
    if isinstance(want, dict) and isinstance(got, dict):
        if sorted(map(str, got)) != sorted(map(str, want)):
            return [f"{path}: keys {sorted(map(str, got))} != {sorted(map(str, want))}"]
        return [d for k in want for d in differences(got[k], want[k], f"{path}.{k}".lstrip("."), rel)]
    if isinstance(want, (list, tuple)) and isinstance(got, (list, tuple)):
        if len(got) != len(want):
            return [f"{path}: {len(got)} entries, expected {len(want)}: {str(got)[:300]} != {str(want)[:300]}"]
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in differences(g, w, f"{path}[{i}]", rel)]
    return [] if got == want else [f"{path}: {str(got)[:200]} != {str(want)[:200]} (the reference)"]


def float32(series: dict[str, list[tuple[int, float]]]) -> dict[str, list[tuple[int, float]]]:
    """Values as TensorBoard stores them (float32)."""
    return {k: [(s, float(torch.tensor(v, dtype=torch.float32))) for s, v in points]
            for k, points in series.items()}


def assert_same(got: Any, want: Any, what: str, approx: bool = False) -> None:
    diffs = differences(got, want, rel=1e-4 if approx else 0.0)
    assert not diffs, f"{what}:\n  " + "\n  ".join(diffs[:15])


def up_to(series: dict[str, list[tuple[int, float]]], step: int) -> dict[str, list[tuple[int, float]]]:
    return {k: [p for p in v if p[0] <= step] for k, v in series.items() if any(p[0] <= step for p in v)}


# ------------------------------------------------------------------ the reference itself

def check_reference(row: str, runs: Runs, ref: Outcome) -> None:
    """The reference's components agree with each other and with independent computations."""
    d = ref.run_dir
    logged = rb.jsonl(d)
    if row == "metrics.jsonl":
        assert [s for s, _ in logged["train/loss"]] == list(range(LOG_EVERY, 13, LOG_EVERY))
        assert [s for s, _ in logged["val/loss"]] == [3, 6, 9, 12]
        assert all(math.isfinite(v) for series in logged.values() for _, v in series)
    elif row == "tensorboard scalars":
        assert_same(up_keys(view(row, d), logged), float32(logged), "TensorBoard scalars vs metrics.jsonl")
    elif row == "tensorboard media":
        media = view(row, d)
        at_log_point = [-(-s // LOG_EVERY) * LOG_EVERY for s in range(1, 13)]  # media: written there
        assert [s for s, _ in media["train/grid"]] == [at_log_point[s - 1] for s in (3, 6, 9, 12)]
        assert [s for s, _ in media["train/note/text_summary"]] == [at_log_point[s - 1] for s in range(1, 13)
                                                                   if s % 3 != 1]
        assert [s for s, *_ in media["val/logits"]] == [3, 3, 6, 6, 9, 9, 12, 12]
    elif row == "mlflow":
        (run,) = rb.mlflow_runs(d)
        assert run.info.status == "FINISHED"
        assert_same(up_keys(view(row, d), logged), logged, "MLflow history vs metrics.jsonl")
    elif row == "mlflow media":  # every text and histogram TensorBoard keeps, MLflow keeps
        mlflow, tb = view(row, d), rb.tensorboard(d)[1]
        counts = {k: len(v) for k, v in mlflow.items()}
        assert counts == {"texts/train/note": len(tb["train/note/text_summary"]),
                          "histograms/train/weights": len(tb["train/weights"]),
                          "histograms/val/logits": len(tb["val/logits"]),
                          "histograms/val_ema/logits": len(tb["val_ema/logits"]),  # (trainer.ema)
                          "images/train/grid": len(tb["train/grid"])}, counts
    elif row == "wandb":
        (one,) = rb.wandb_runs(d).values()
        assert_same(up_keys(rb.wandb_series(one), logged), logged, "W&B history vs metrics.jsonl")
    elif row == "best":
        got = view(row, d)
        value, step = min((v, s) for s, v in logged["val/loss"])
        assert (got["value"], got["step"]) == (pytest.approx(value), step)
        assert ref.job.best.step == step
        at_best = rb.load_checkpoint_at(d, step)
        assert_same(got["model_best.pt"], at_best["model"], "model_best.pt vs the best step's checkpoint")
    elif row == "early stopping":
        got = view(row, d)
        losses = [v for _, v in logged["val/loss"]]
        assert got["best"] == pytest.approx(min(losses))
        assert got["bad_validations"] == len(losses) - 1 - losses.index(min(losses))
    elif row == "scheduler":  # the lr of every logged step, from torch's scheduler by hand
        from saferun.schedules import warmup_cosine

        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.2)
        sched = warmup_cosine(opt, 2, 12, 0.1)
        by_hand = []
        for step in range(1, 13):
            if step % LOG_EVERY == 0:
                by_hand.append((step, pytest.approx(opt.param_groups[0]["lr"], rel=1e-6)))
            opt.step()
            sched.step()
        assert logged["train/lr"] == by_hand
    elif row == "plateau":
        got = view(row, d)
        plateau = rb.jsonl(d)["val/loss"]
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.2)
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
        for _, v in plateau:
            sched.step(v)
        assert got["param_groups"] == [pytest.approx(opt.param_groups[0]["lr"])]
        assert got["scheduler"]["num_bad_epochs"] == sched.state_dict()["num_bad_epochs"]
    elif row == "ema":  # model_ema.pt is the checkpoint's average of all 12 steps, not the weights
        got = view(row, d)
        average = {k.removeprefix("module."): v for k, v in got["checkpoint"].items() if k != "n_averaged"}
        assert int(got["checkpoint"]["n_averaged"]) == 12
        assert_same(got["model_ema.pt"], average, "model_ema.pt vs the final checkpoint's average")
        final = rb.weights(d / "model.pt")
        assert final is not None and not any(torch.equal(final[k], v) for k, v in average.items())
    elif row == "spikes":  # every step compared and kept (finite, none a spike): 12 in each
        (detectors,) = view(row, d)
        assert set(detectors) == {"loss", "grad_norm"}
        for key, state in detectors.items():
            assert int(state["count"]) == int(state["updates"]) == 12, (key, state)
            assert state["values"].shape == (6,) and bool(torch.isfinite(state["values"]).all())
            assert math.isfinite(float(state["limit"]))  # warmed up (from step 2)
        losses = [v for _, v in logged["train/loss"]]  # the last log point's mean, of steps 11, 12
        assert float(detectors["loss"]["values"].min()) <= losses[-1] <= \
            float(detectors["loss"]["values"].max())
    elif row == "checkpoint":
        got = view(row, d)
        assert got["loop"]["step"] == 12
        assert_same(rb.weights(d / "model.pt"), got["model"], "model.pt vs the final checkpoint")
    else:
        raise AssertionError(row)


def up_keys(series: dict[str, Any], logged: dict[str, Any]) -> dict[str, Any]:
    """`series` restricted to the keys metrics.jsonl has (trackers add none of their own)."""
    missing = set(logged) - set(series)
    assert not missing, f"keys never logged: {sorted(missing)}"
    return {k: series[k] for k in logged}


# ------------------------------------------------------------------ the other events

def per_rank(row: str, held: Any) -> Any:
    """Two ranks: a histogram of validation outputs logged in validation_step is rank 0's
    shard (media are logged on rank 0, docs/logging.md): compare its steps only."""
    if row == "tensorboard media":
        return {k: [e[0] for e in v] if k.endswith("/logits") else v for k, v in held.items()}
    if row == "mlflow media":
        return {k: len(v) if k.endswith("/logits") else v for k, v in held.items()}
    if row == "spikes":  # a rank's loss detector sees its half's loss; the gradient norm's sees
        # the averaged gradients' norm, the same on every rank: that one compares
        norms = [rank["grad_norm"] for rank in held]
        assert all(not differences(n, norms[0], rel=1e-4) for n in norms), "ranks' detectors differ"
        return norms[0]
    return held


def check_equal(row: str, got: Outcome, want: Outcome, approx: bool = False) -> None:
    assert got.error is None, f"refused: {got.error}"
    held = wandb_view(got.run_dir, got.old) if row == "wandb" else view(row, got.run_dir)
    wanted = view(row, want.run_dir)
    if approx:
        held, wanted = per_rank(row, held), per_rank(row, wanted)
    assert_same(held, wanted, f"{row} after {got.run_dir.name} vs the reference", approx)
    if row == "mlflow":
        statuses = [r.info.status for r in rb.mlflow_runs(got.run_dir)]
        assert statuses[-1] == "FINISHED" and "RUNNING" not in statuses, statuses
    if row == "wandb" and got.run_dir.name in ("sigkill", "sigkill_in_validation", "sigterm",
                                                 "second_fit", "two_ranks"):
        assert len(rb.wandb_runs(got.run_dir)) == 1  # a resume continues its W&B run


def check_wandb_killed(got: Outcome, want: Outcome) -> None:
    """W&B after a SIGKILL (grid.WANDB_KILLED): the resume names the steps W&B may lack; W&B
    holds every other step as the reference does, and of the named ones only right values."""
    assert got.error is None, f"refused: {got.error}"
    said = [m for m in got.notes["warnings"] if "W&B" in m and "may lack steps" in m]
    assert said, "W&B lost rows of the killed run and the resume did not say which"
    first, last = map(int, re.search(r"may lack steps (\d+) to (\d+)", said[0]).groups())
    held, wanted = wandb_view(got.run_dir), view("wandb", want.run_dir)

    def outside(series: dict[str, Any]) -> dict[str, Any]:
        return {k: [p for p in v if not first <= p[0] <= last] for k, v in series.items()}

    assert_same(outside(held), outside(wanted), f"W&B after {got.run_dir.name} outside the "
                                                 f"steps {first} to {last} it warned of")
    wrong = {k: [p for p in v if p not in wanted.get(k, [])] for k, v in held.items()}
    assert not any(wrong.values()), f"W&B holds values the reference never logged: {wrong}"
    kept = sorted({s for v in held.values() for s, _ in v if first <= s <= last})
    assert not kept, f"the warning names steps {first} to {last}, but W&B holds steps {kept}"
    assert len(rb.wandb_runs(got.run_dir)) == 1  # a resume continues its W&B run


def check_course(row: str, runs: Runs, got: Outcome) -> None:
    """The new course equals a plain resume with the new setting; the old course is kept."""
    assert got.error is None, f"refused: {got.error}"
    check_equal(row, got, runs["course_reference"])
    if row not in LOG_ROWS:
        return
    ref = runs["reference"]  # the old course ran the reference's configuration to its end
    if row in ("metrics.jsonl", "tensorboard scalars", "tensorboard media"):
        old = got.old if got.old != got.run_dir else rb_superseded(got.run_dir)
        assert_same(view(row, old), view(row, ref.run_dir), f"{row} of the old course, set aside")
    elif row in ("mlflow", "mlflow media"):
        old_run, *later = rb.mlflow_runs(got.old)  # the old course's run: the first of its directory
        new = rb.mlflow_runs(got.run_dir)[-1]
        assert new.info.run_id != old_run.info.run_id, "the new course writes into the old course's run"
        assert got.old != got.run_dir or later, "no MLflow run of the new course"
        if row == "mlflow":
            assert_same(rb.mlflow_series(got.old, old_run), view(row, ref.run_dir), "the old course's MLflow run")
        else:
            assert_same(rb.mlflow_media(old_run), view(row, ref.run_dir), "the old course's MLflow media")
    elif row == "wandb":
        found = rb.wandb_runs(got.old)
        assert len(found) >= 1
        first = found[list(found)[0]]
        assert_same(rb.wandb_series(first), wandb_view(ref.run_dir), "the old course's W&B run")


def rb_superseded(run_dir: Path) -> Path:
    (aside,) = [p for p in run_dir.iterdir() if p.name.startswith("superseded-")]
    return aside


def check_refused(row: str, runs: Runs, got: Outcome) -> None:
    assert isinstance(got.error, NonFiniteError), got.error
    check_bad_step(row, got, promise_finite=True)
    if row in ("metrics.jsonl", "tensorboard scalars", "mlflow", "wandb"):
        before = got.notes["last good log point"]
        assert_same(up_to(view(row, got.run_dir), before), up_to(view(row, runs["reference"].run_dir), before),
                    f"{row} up to the last good step vs the reference")


def check_bad_step(row: str, got: Outcome, promise_finite: bool) -> None:
    """The components agree with the run's own metrics.jsonl; no checkpoint is non-finite."""
    d = got.run_dir
    logged = rb.jsonl(d)
    if row in ("tensorboard scalars", "mlflow", "wandb"):
        want = float32(logged) if row == "tensorboard scalars" else logged
        assert_same(up_keys(view(row, d), logged), want, f"{row} vs metrics.jsonl")
    elif row == "tensorboard media":
        steps = [s for s, _ in view(row, d)["train/grid"]]  # each once, at a logged step
        assert steps == sorted(set(steps)) and set(steps) <= {s for s, _ in logged["train/loss"]}, steps
    elif row == "mlflow media":
        tb = rb.tensorboard(d)[1]
        assert {k: len(v) for k, v in view(row, d).items()}["images/train/grid"] == len(tb["train/grid"])
    elif row == "metrics.jsonl":  # each step once, in order: what a rollback undid is cut off
        for key, points in logged.items():
            steps = [step for step, _ in points]
            assert steps and steps == sorted(set(steps)), f"{key} logged at steps {steps}"
    elif row == "spikes":  # in every checkpoint saved: no NaN or Inf entered a window (an empty
        # slot is NaN), and no more values were kept than compared
        for step in rb.saved_steps(d):
            for rank in rb.load_checkpoint_at(d, step)["per_rank"]:
                for key, state in rank["spikes"].items():
                    assert not bool(torch.isinf(state["values"]).any()), (step, key, state["values"])
                    assert 0 < int(state["count"]) <= int(state["updates"]), (step, key, state)
    elif promise_finite and row in ("checkpoint", "ema"):  # every checkpoint saved
        parts = ("model", "optimizer") if row == "checkpoint" else ("ema",)
        bad = [s for s in rb.saved_steps(d)
               if not rb.all_finite({k: rb.load_checkpoint_at(d, s)[k] for k in parts})]
        assert not bad, f"the checkpoints of steps {bad} hold non-finite {' or '.join(parts)} values"
    elif row == "best" and (d / "model_best.pt").is_file():
        assert rb.all_finite(rb.weights(d / "model_best.pt")), "model_best.pt is non-finite"
        assert math.isfinite(rb.final_checkpoint(d)["loop"]["best"][0])
    elif row == "early stopping" and rb.final_checkpoint(d) is not None:
        best = rb.callback_state(rb.final_checkpoint(d), "EarlyStopping")["best"]
        assert best is None or math.isfinite(best)
    elif row == "scheduler":
        assert all(math.isfinite(v) for _, v in logged["train/lr"])


@pytest.mark.parametrize("row, event", params())
def test_cell(runs: Runs, row: str, event: str) -> None:
    if event.startswith("sweep"):
        from sweep_cells import check_sweep

        check_sweep(row, event, runs)
        return
    if row == "plateau":
        got, ref = runs[PLATEAU_EVENTS[event]], runs["plateau_reference"]
    else:
        got, ref = runs[event], runs["reference"]
    kind = KIND[event]
    if kind == "course":
        runs["course_reference"]  # run before W&B's files are read
    if row == "wandb":
        flush_wandb()
    if event == "reference":
        check_reference(row, runs, got)
    elif row == "wandb" and event in WANDB_KILLED:
        check_wandb_killed(got, ref)
    elif kind == "equal":
        check_equal(row, got, ref, approx=event == "two_ranks")
    elif kind == "equal or refused":
        if got.error is not None:
            assert isinstance(got.error, SaferunError) and "max_steps" in str(got.error), got.error
        else:
            check_equal(row, got, ref)
    elif kind == "course":
        check_course(row, runs, got)
    elif kind == "refused":
        check_refused(row, runs, got)
    else:
        check_bad_step(row, got, promise_finite=event != "nonfinite_off")
