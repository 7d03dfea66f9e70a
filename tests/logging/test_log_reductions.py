"""self.log(name, value, reduce=...): what each reduction logs, against values computed by hand;
the same as a returned dict for "mean", bitwise; no host read between log points."""

import json

import pytest
import torch
import torch.nn.functional as F

from saferun.errors import SaferunError
from saferun.guards.syncs import HostSyncCounter
from toys import ToyTrainer, toy_config


def jsonl(run_dir, kind="train"):
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if x["kind"] == kind]


def cfg(tmp_path, name="run", **trainer):
    c = toy_config(tmp_path, **trainer)
    c["trainer"]["run_dir"] = str(tmp_path / name)
    c["logger"] = {"jsonl": {"_target_": "saferun.loggers.MetricsJsonl"}}
    return c


class Schedules(ToyTrainer):
    """Logs a KL-like warm-up weight with each reduction: the value of step s is s / 30."""

    def training_step(self, batch):
        w = torch.tensor(self.step / 30)
        for reduce in ("mean", "last", "min", "max", "sum"):
            self.log(f"w_{reduce}", w, reduce=reduce)
        return super().training_step(batch)

    def validation_step(self, batch):
        out = super().validation_step(batch)
        n = torch.tensor(float(len(batch[0])))
        self.log("batch_max", n, reduce="max")
        self.log("batch_min", n, reduce="min")
        self.log("samples", n, reduce="sum")
        self.log("last_n", n, reduce="last")
        return out


def test_each_reduction_logs_what_it_says_over_each_window(tmp_path):
    t = Schedules(cfg(tmp_path, max_steps=20, log_every_n_steps=10, val_every_n_steps=20,
                      batch_size=32, val_batch_size=24))
    t.fit()
    rows = jsonl(tmp_path / "run")
    assert [r["step"] for r in rows] == [10, 20]
    for r, steps in zip(rows, (range(1, 11), range(11, 21))):
        values = [torch.tensor(s / 30).item() for s in steps]
        assert r["train/w_last"] == values[-1]  # 10/30 = 0.333 at step 10, not the mean
        assert r["train/w_min"] == values[0] and r["train/w_max"] == values[-1]
        assert r["train/w_sum"] == pytest.approx(sum(values), rel=1e-6)
        assert r["train/w_mean"] == pytest.approx(sum(values) / 10, rel=1e-6)
    val = jsonl(tmp_path / "run", "val")[-1]  # 64 samples in batches of 24, 24, 16
    assert (val["val/batch_max"], val["val/batch_min"], val["val/samples"], val["val/last_n"]) \
        == (24.0, 16.0, 64.0, 16.0)


class Returns(ToyTrainer):
    def training_step(self, batch):
        x, y = batch
        logits = self.model(x)
        return {"loss": F.cross_entropy(logits, y), "acc": (logits.argmax(1) == y).float().mean()}

    def validation_step(self, batch):
        x, y = batch
        logits = self.model(x)
        return {"loss": F.cross_entropy(logits, y), "acc": (logits.argmax(1) == y).float().mean()}


class Logs(ToyTrainer):
    """The Lightning way: self.log() everything (the loss too), return the loss only."""

    def training_step(self, batch):
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits, y)
        self.log("loss", loss)
        self.log("acc", (logits.argmax(1) == y).float().mean())
        return loss

    def validation_step(self, batch):
        x, y = batch
        logits = self.model(x)
        self.log("loss", F.cross_entropy(logits, y))
        self.log("acc", (logits.argmax(1) == y).float().mean())


@pytest.mark.parametrize("accumulate", [1, 2])
def test_logged_means_equal_returned_values_bitwise(tmp_path, accumulate):
    kw = dict(max_steps=12, log_every_n_steps=4, val_every_n_steps=6, accumulate=accumulate,
              batch_size=24)
    Returns(cfg(tmp_path, "returned", **kw)).fit()
    Logs(cfg(tmp_path, "logged", **kw)).fit()
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(("perf/", "time"))}  # noqa: E731
                          for r in rows]
    for kind in ("train", "val"):
        a, b = strip(jsonl(tmp_path / "returned", kind)), strip(jsonl(tmp_path / "logged", kind))
        assert a == b and f"{kind}/acc" in a[-1]


def test_under_accumulation_each_micro_batch_counts_and_last_is_the_last_one(tmp_path):
    class Micro(ToyTrainer):
        calls = 0

        def training_step(self, batch):
            Micro.calls += 1  # 1, 2 in step 1; 3, 4 in step 2; ...
            for reduce in ("last", "sum", "min"):
                self.log(f"call_{reduce}", float(Micro.calls), reduce=reduce)
            return super().training_step(batch)

    Micro(cfg(tmp_path, max_steps=4, log_every_n_steps=4, batch_size=16, accumulate=2)).fit()
    row = jsonl(tmp_path / "run")[-1]
    assert (row["train/call_last"], row["train/call_sum"], row["train/call_min"]) == (8, 36, 1)


def test_no_host_read_between_log_points(tmp_path):
    t = Schedules(cfg(tmp_path, max_steps=60, log_every_n_steps=20, val_every_n_steps=20))
    with HostSyncCounter() as counter:
        t.fit()
    # 3 log points, 3 validations, the final save (its check of the state): one read each
    assert counter.count == 3 + 3 + 1, counter.sites


def test_one_name_in_training_and_validation_may_keep_a_reduction_each(tmp_path):
    """train/acc and val/acc are two metrics, so each has its own reduction."""
    class Both(ToyTrainer):
        def training_step(self, batch):
            x, y = batch
            logits = self.model(x)
            self.log("acc", (logits.argmax(1) == y).float().mean())
            return F.cross_entropy(logits, y)

        def validation_step(self, batch):
            x, y = batch
            self.log("acc", (self.model(x).argmax(1) == y).float().mean(), reduce="min")
            return {}

    metrics = Both(cfg(tmp_path, max_steps=4, val_every_n_steps=2)).fit()
    assert "val/acc" in metrics and "train/acc" in metrics


@pytest.mark.parametrize("call, message", [
    (lambda t, v: t.log("x", v, on_step=True), "on_step: training values are reduced"),
    (lambda t, v: t.log("x", v, sync_dist=True), "sync_dist: saferun always reduces"),
    (lambda t, v: t.log("x", v, reduce="median"), "reduce is one of mean, last"),
    (lambda t, v: t.log("x", torch.ones(3)), r"takes a scalar .*got \(3,\)"),
    (lambda t, v: (t.log("x", v), t.log("x", v, reduce="max")), "a name keeps one reduction"),
    (lambda t, v: t.log("loss", v * 2), "both returns and self.log"),
])
def test_mistakes_are_refused_with_what_to_do(tmp_path, call, message):
    class Wrong(ToyTrainer):
        def training_step(self, batch):
            loss = super().training_step(batch)
            call(self, loss)
            return loss

    with pytest.raises(SaferunError, match=message):
        Wrong(cfg(tmp_path, max_steps=2)).fit()
