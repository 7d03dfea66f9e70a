"""Callbacks that need the model (on_evaluate): eval mode under inference_mode, the purity guard,
the ranks asked for, outputs logged with the validation; and every reduction under real torchrun
(2 gloo ranks)."""

import json
import subprocess
import sys

import pytest
import torch

import saferun
from saferun.callbacks import CallbackList
from saferun.errors import SaferunError
from toys import ToyTrainer, toy_config

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "parallel"))
from helpers import free_port  # noqa: E402
from test_torchrun import TIMEOUT  # noqa: E402


class Samples(saferun.Callback):
    """Generates from the model on a fixed batch: sees it in eval mode without autograd."""

    def __init__(self):
        self.seen = []

    def on_evaluate(self, view, model, log):
        out = model(torch.ones(2, 8))
        self.seen.append((view.step, model.training, torch.is_grad_enabled(), out.requires_grad))
        log.log("sample_mean", out.mean())
        log.log_image("sample", torch.sigmoid(out))  # (2, 3): an (H, W) image


def cfg(tmp_path):
    c = toy_config(tmp_path, max_steps=4, log_every_n_steps=2, val_every_n_steps=2)
    c["logger"] = {"jsonl": {}}
    return c


def test_on_evaluate_runs_in_eval_mode_without_autograd_and_its_logs_join_the_validation(tmp_path):
    class Written(saferun.Callback):
        media = []

        def on_media(self, view, media):
            self.media += [(m.kind, m.name, m.step, tuple(m.value.shape)) for m in media]

    samples, written = Samples(), Written()
    t = ToyTrainer(cfg(tmp_path), callbacks=[samples, written])
    final = t.fit()
    assert samples.seen == [(2, False, False, False), (4, False, False, False)]
    assert t.model.training  # training mode restored after
    assert "val/sample_mean" in final and "val/acc" in final
    assert written.media == [("image", "val/sample", 2, (2, 3)), ("image", "val/sample", 4, (2, 3))]


def test_on_evaluate_that_changes_the_model_is_caught_by_the_purity_guard(tmp_path):
    class Corrupts(saferun.Callback):
        def on_evaluate(self, view, model, log):
            model.backbone[1].running_mean.add_(1.0)  # BatchNorm statistics

    with pytest.raises(SaferunError, match="running_mean"):
        ToyTrainer(cfg(tmp_path), callbacks=[Corrupts()]).fit()


def test_on_evaluate_logging_a_name_validation_step_reports_is_refused(tmp_path):
    class Clash(saferun.Callback):
        def on_evaluate(self, view, model, log):
            log.log("acc", 1.0)

    with pytest.raises(SaferunError, match="on_evaluate logs 'acc', which validation_step reports"):
        ToyTrainer(cfg(tmp_path), callbacks=[Clash()]).fit()


def test_under_fsdp_only_callbacks_that_run_code_on_the_model_must_run_on_every_rank():
    """A sharded forward needs every rank, so an on_evaluate on rank 0 alone is refused; a
    callback that does not override on_evaluate (the default loggers) runs nothing there."""
    class Plain(saferun.Callback):
        pass

    seen = []

    class OnEveryRank(saferun.Callback):
        evaluate_ranks = "all"

        def on_evaluate(self, view, model, log):
            seen.append(model)

    model = torch.nn.Linear(2, 2)
    CallbackList([Plain(), OnEveryRank()]).on_evaluate(None, model, None, is_main=False,
                                                       sharded=True)
    assert seen == [model]
    with pytest.raises(SaferunError, match="needs every rank"):
        CallbackList([Samples()]).on_evaluate(None, model, None, is_main=True, sharded=True)


def test_evaluate_ranks_must_be_main_or_all(tmp_path):
    class Odd(Samples):
        evaluate_ranks = "rank1"

    with pytest.raises(SaferunError, match="evaluate_ranks is 'rank1'"):
        ToyTrainer(cfg(tmp_path), callbacks=[Odd()]).fit()


SCRIPT = """
import atexit, json, os, sys
import torch
import saferun
from toys import ToyTrainer, toy_config

def group_at_teardown():  # registered first, so it runs after saferun's own exit handler
    with open(os.path.join(sys.argv[1], f"exit{os.environ['RANK']}.txt"), "w") as f:
        f.write(str(torch.distributed.is_initialized()))
atexit.register(group_at_teardown)

class Ranked(ToyTrainer):
    def training_step(self, batch):
        v = torch.tensor(self.step * 10.0 + self.ranks.rank)
        for reduce in ("mean", "last", "min", "max", "sum"):
            self.log(f"v_{reduce}", v, reduce=reduce)
        if self.ranks.rank == 1 or self.step < 4:  # rank 0 skips the last step
            self.log("late", v, reduce="last")
        return super().training_step(batch)

    def validation_step(self, batch):
        self.log("rank_last", float(self.ranks.rank), reduce="last")
        self.log("rank_sum", 1.0, reduce="sum")
        return super().validation_step(batch)

class OnAll(saferun.Callback):
    evaluate_ranks = "all"
    def on_evaluate(self, view, model, log):
        log.log("probe_all", float(view.rank))

class OnMain(saferun.Callback):
    def on_evaluate(self, view, model, log):
        log.log("probe_main", float(view.rank + 7))

cfg = toy_config(__import__("pathlib").Path(sys.argv[1]), max_steps=4, log_every_n_steps=4, val_every_n_steps=4,
                 val_batch_size=16)
t = Ranked(cfg, callbacks=[OnAll(), OnMain()])
final = t.fit()
with open(os.path.join(sys.argv[1], f"rank{t.ranks.rank}.json"), "w") as f:
    json.dump(final, f)
"""


def test_every_reduction_is_agreed_over_two_real_ranks(tmp_path):
    script = tmp_path / "ranked.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           f"--master_port={free_port()}", str(script), str(tmp_path)],
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    # the group saferun started is left before interpreter teardown (left to teardown,
    # gloo can abort a rank with SIGABRT after a run that succeeded)
    assert [(tmp_path / f"exit{r}.txt").read_text() for r in (0, 1)] == ["False", "False"]
    values = [s * 10.0 + r for s in range(1, 5) for r in (0, 1)]
    for final in got:
        assert final["train/v_min"] == 10.0 and final["train/v_max"] == 41.0
        assert final["train/v_sum"] == sum(values)
        assert final["train/v_last"] == 40.0  # the last step's, from rank 0
        assert final["train/late"] == 41.0  # the latest step's, from the one rank that logged it
        assert final["train/v_mean"] == pytest.approx(sum(values) / len(values))
        # 64 validation samples, 32 per rank in batches of 16: 2 batches a rank
        assert final["val/rank_last"] == 0.0 and final["val/rank_sum"] == 4.0
        assert final["val/probe_all"] == 0.5 and final["val/probe_main"] == 7.0
    same = [{k: v for k, v in final.items() if not k.startswith("perf/")} for final in got]
    assert same[0] == same[1]


def test_on_evaluate_and_on_media_fire_in_the_documented_order(tmp_path):
    events = []

    class Recorder(saferun.Callback):
        def on_log(self, view, metrics):
            events.append(("log", view.step))

        def on_evaluate(self, view, model, log):
            events.append(("evaluate", view.step))
            log.log_text("t", "x")

        def on_validation_end(self, view, metrics):
            events.append(("validation_end", view.step))

        def on_media(self, view, media):
            events.append(("media", view.step, [m.name for m in media]))

    class Images(ToyTrainer):
        def training_step(self, batch):
            if self.step == 1:
                self.log_image("first", torch.zeros(4, 4))
            return super().training_step(batch)

    Images(cfg(tmp_path), callbacks=[Recorder()]).fit()
    assert events == [("log", 2), ("media", 2, ["train/first"]),
                      ("evaluate", 2), ("validation_end", 2), ("media", 2, ["val/t"]),
                      ("log", 4), ("evaluate", 4), ("validation_end", 4), ("media", 4, ["val/t"])]
