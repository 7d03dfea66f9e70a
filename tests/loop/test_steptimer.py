"""Where a step's time goes (issue 35): perf/data_wait_ms, perf/forward_backward_ms,
perf/optimizer_ms, perf/guards_ms and perf/step_ms, timed on the step of each log point."""

import json
import time

import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import saferun

PHASES = ("perf/data_wait_ms", "perf/forward_backward_ms", "perf/optimizer_ms", "perf/guards_ms")
SLEEP = 0.005  # seconds: a planted delay is at least this long, whatever the machine's load


class Mlp(saferun.Trainer):
    def build_model(self):
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def build_datasets(self):
        g = torch.Generator().manual_seed(0)
        return TensorDataset(torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g)), None

    def training_step(self, batch):
        x, y = batch
        return F.cross_entropy(self.model(x), y)


class SlowSamples(Dataset):
    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        time.sleep(SLEEP)
        return self.data[i]


class SlowLoader(Mlp):
    def build_datasets(self):
        return SlowSamples(super().build_datasets()[0]), None


class SlowSGD(torch.optim.SGD):
    def step(self, closure=None):
        time.sleep(8 * SLEEP)
        return super().step(closure)


class SlowOptimizer(Mlp):
    def build_optimizer(self, params):
        return SlowSGD(params, lr=0.1)


class StepEnds(saferun.Callback):
    """The host clock at the end of each step, outside saferun's timer."""

    def __init__(self):
        self.at = {}

    def on_train_step_end(self, view, output):
        self.at[view.step] = time.perf_counter()


def config(tmp_path, **trainer):
    return {"trainer": {"max_steps": 12, "batch_size": 8, "log_every_n_steps": 4,
                        "run_dir": str(tmp_path / "run"), "progress_bar": False, **trainer}}


def logged(tmp_path):
    return [x for x in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
            if x.get("kind") == "train"]


def test_each_log_point_splits_its_step_to_every_logger(tmp_path):
    ends = StepEnds()
    final = Mlp(config(tmp_path, max_steps=10), callbacks=[ends]).fit()  # the last: no multiple
    lines = logged(tmp_path)
    assert [x["step"] for x in lines] == [4, 8, 10]
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    for name in (*PHASES, "perf/step_ms"):
        assert [e.step for e in acc.Scalars(name)] == [4, 8, 10], name
        assert [e.value for e in acc.Scalars(name)] == [
            float(torch.tensor(x[name], dtype=torch.float32)) for x in lines], name
        assert final[name] == lines[-1][name]
    for x in lines:
        phases = [x[name] for name in PHASES]
        assert min(phases) >= 0.0, x
        assert sum(phases) <= x["perf/step_ms"], x
        # the phases lie between the end of the step before and this step's end (host clock)
        assert sum(phases) <= 1e3 * (ends.at[x["step"]] - ends.at[x["step"] - 1]), x


def test_a_slow_data_loader_shows_as_data_wait(tmp_path):
    SlowLoader(config(tmp_path, max_steps=8)).fit()
    for x in logged(tmp_path):
        assert x["perf/data_wait_ms"] >= 1e3 * 8 * SLEEP, x  # 8 samples, each slept
        assert x["perf/data_wait_ms"] > sum(x[name] for name in PHASES[1:]), x


def test_a_slow_optimizer_step_shows_as_optimizer_time(tmp_path):
    SlowOptimizer(config(tmp_path, max_steps=8)).fit()
    for x in logged(tmp_path):
        assert x["perf/optimizer_ms"] >= 1e3 * 8 * SLEEP, x
        others = [x[name] for name in PHASES if name != "perf/optimizer_ms"]
        assert x["perf/optimizer_ms"] > sum(others), x


def test_several_optimizers_split_only_the_data_wait(tmp_path):
    """training_step drives the optimizers, interleaving forward, backward and updates: no
    phase of it is reported rather than one that would count another's time."""

    class Two(Mlp):
        def build_optimizer(self, params):
            return {"first": torch.optim.SGD(self.model[0].parameters(), lr=0.1),
                    "last": torch.optim.SGD(self.model[2].parameters(), lr=0.1)}

        def training_step(self, batch):
            x, y = batch
            self.optimize("last", F.cross_entropy(self.model(x), y), retain_graph=True)
            self.optimize("first", F.cross_entropy(self.model(x), y))

    final = Two(config(tmp_path, max_steps=8)).fit()
    assert 0.0 <= final["perf/data_wait_ms"] <= final["perf/step_ms"]
    assert not {name for name in PHASES[1:] if name in final}


def test_logging_every_step_times_every_step_without_the_validation_before_it(tmp_path):
    """With a log point at every step, each step is timed from the end of the one before,
    after that step's validation: a slow validation is in no phase of the next step."""

    class SlowValidation(Mlp):
        def build_datasets(self):
            train = super().build_datasets()[0]
            return train, SlowSamples(train)

        def validation_step(self, batch):
            x, y = batch
            return {"loss": F.cross_entropy(self.model(x), y)}

    class Ends(StepEnds):
        validated = {}

        def on_validation_end(self, view, metrics):
            self.validated[view.step] = time.perf_counter()

    ends = Ends()
    SlowValidation(config(tmp_path, max_steps=4, log_every_n_steps=1, val_every_n_steps=1,
                          limit_val_batches=1), callbacks=[ends]).fit()
    lines = logged(tmp_path)
    assert [x["step"] for x in lines] == [1, 2, 3, 4] and sorted(ends.validated) == [1, 2, 3, 4]
    for x in lines[1:]:  # the phases lie between the validation before and the step's end
        phases = sum(x[name] for name in PHASES)
        assert phases <= 1e3 * (ends.at[x["step"]] - ends.validated[x["step"] - 1]), x
