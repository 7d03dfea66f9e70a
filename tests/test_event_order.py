"""The loop's event order, as documented in saferun.callbacks, pinned."""

import pytest

from saferun import Callback, Control
from toys import ToyTrainer, toy_config


class Recorder(Callback):
    def __init__(self):
        self.events = []

    def on_fit_start(self, view):
        self.events.append(("fit_start", view.step))

    def on_train_step_end(self, view, output):
        self.events.append(("train_step_end", view.step))

    def on_log(self, view, metrics):
        self.events.append(("log", view.step))

    def on_validation_end(self, view, metrics):
        self.events.append(("validation_end", view.step))

    def on_checkpoint(self, view, path):
        assert path.endswith(f"step-{view.step:08d}")
        self.events.append(("checkpoint", view.step))

    def on_fit_end(self, view, metrics):
        self.events.append(("fit_end", view.step))

    def on_exception(self, view, exc):
        self.events.append(("exception", view.step))


def steps(a, b):
    return [("train_step_end", s) for s in range(a, b + 1)]


def test_two_epochs_with_logging_validation_and_checkpoints(tmp_path):
    # 256 samples / 32 = 8 steps per epoch; 16 steps = 2 epochs; log every 5 steps;
    # validation at each epoch's end; a checkpoint every 10 steps and at the end
    rec = Recorder()
    ToyTrainer(toy_config(tmp_path, max_steps=16, log_every_n_steps=5, save_every_n_steps=10),
               callbacks=[rec]).fit()
    expected = (
        [("fit_start", 0)] + steps(1, 5) + [("log", 5)] + steps(6, 8) + [("validation_end", 8)]
        + steps(9, 10) + [("log", 10), ("checkpoint", 10)] + steps(11, 15) + [("log", 15)]
        + steps(16, 16) + [("validation_end", 16), ("log", 16), ("checkpoint", 16), ("fit_end", 16)]
    )
    assert rec.events == expected


def test_stop_mid_epoch_still_logs_validates_and_ends(tmp_path):
    class StopAt3(Recorder):
        def on_train_step_end(self, view, output):
            super().on_train_step_end(view, output)
            return Control(stop=view.step == 3)

    rec = StopAt3()
    ToyTrainer(toy_config(tmp_path, max_steps=16, log_every_n_steps=5), callbacks=[rec]).fit()
    assert rec.events == [("fit_start", 0)] + steps(1, 3) + [
        ("log", 3), ("validation_end", 3), ("checkpoint", 3), ("fit_end", 3)]


def test_evaluate_request_runs_validation_after_that_step(tmp_path):
    class EvalAt2(Recorder):
        def on_log(self, view, metrics):
            super().on_log(view, metrics)
            return Control(evaluate=True)

    rec = EvalAt2()
    ToyTrainer(toy_config(tmp_path, max_steps=4, log_every_n_steps=2), callbacks=[rec]).fit()
    assert rec.events == [("fit_start", 0)] + steps(1, 2) + [("log", 2), ("validation_end", 2)] + steps(
        3, 4) + [("log", 4), ("validation_end", 4), ("checkpoint", 4), ("fit_end", 4)]


def test_exception_reaches_callbacks_then_propagates(tmp_path):
    class Boom(ToyTrainer):
        def training_step(self, batch):
            if self.state.step == 2:
                raise KeyError("planted")
            return super().training_step(batch)

    rec = Recorder()
    with pytest.raises(KeyError, match="planted"):
        Boom(toy_config(tmp_path), callbacks=[rec]).fit()
    assert rec.events == [("fit_start", 0)] + steps(1, 2) + [("exception", 2)]


def test_callbacks_run_in_list_order_and_see_a_read_only_view(tmp_path):
    order = []

    class Named(Callback):
        def __init__(self, name):
            self.name = name

        def on_log(self, view, metrics):
            order.append(self.name)
            with pytest.raises(AttributeError):
                view.step = 0
            assert not hasattr(view, "model") and not hasattr(view, "optimizer")
            with pytest.raises(TypeError):
                view.metrics["train/loss"] = 0.0

    ToyTrainer(toy_config(tmp_path, max_steps=2, log_every_n_steps=2),
               callbacks=[Named("a"), Named("b")]).fit()
    assert order == ["a", "b"]


def test_metrics_in_on_log_are_host_floats(tmp_path):
    seen = {}

    class Keep(Callback):
        def on_log(self, view, metrics):
            seen.update(metrics)

    ToyTrainer(toy_config(tmp_path, max_steps=4, log_every_n_steps=2), callbacks=[Keep()]).fit()
    assert {"train/loss", "train/grad_norm", "train/lr", "perf/steps_per_sec",
            "perf/samples_per_sec"} <= set(seen)
    assert all(type(v) is float for v in seen.values())


def test_task_hooks_finish_validation_and_after_fit(tmp_path):
    rec = Recorder()

    class Hooks(ToyTrainer):
        def finish_validation(self, metrics):
            return {**metrics, "err": 1.0 - metrics["acc"]}

        def after_fit(self, metrics):
            rec.events.append(("after_fit", self.state.step))
            self.final = metrics

    t = Hooks(toy_config(tmp_path, max_steps=4, log_every_n_steps=4), callbacks=[rec])
    metrics = t.fit()
    assert metrics["val/err"] == pytest.approx(1.0 - metrics["val/acc"])
    assert rec.events[-2:] == [("fit_end", 4), ("after_fit", 4)] and t.final == metrics

    class Failing(Hooks):
        def training_step(self, batch):
            raise KeyError("planted")

    rec.events.clear()
    with pytest.raises(KeyError):
        Failing(toy_config(tmp_path / "failing", max_steps=4), callbacks=[rec]).fit()
    assert ("after_fit", 0) not in rec.events


class Asks(Callback):
    """Returns its Control from `event` ("train_step_end" or "log") at `step`, else None."""

    def __init__(self, event, step, **control):
        self.event, self.step, self.control = event, step, Control(**control)

    def _asked(self, event, view):
        return self.control if event == self.event and view.step == self.step else None

    def on_train_step_end(self, view, output):
        return self._asked("train_step_end", view)

    def on_log(self, view, metrics):
        return self._asked("log", view)


def test_the_controls_of_several_callbacks_are_combined(tmp_path):
    rec = Recorder()
    asks = [Asks("train_step_end", 2, **c) for c in ({"evaluate": True}, {"save": True}, {})]
    ToyTrainer(toy_config(tmp_path, max_steps=16, log_every_n_steps=100),
               callbacks=[*asks, rec]).fit()
    assert rec.events[:6] == [("fit_start", 0)] + steps(1, 2) + [
        ("validation_end", 2), ("checkpoint", 2), ("train_step_end", 3)]


def test_the_controls_of_several_callbacks_at_a_log_point_are_combined(tmp_path):
    # on_log's requests go through the same combination as on_validation_end's (the per-step
    # event combines its own): one callback's evaluate and another's save both happen
    rec = Recorder()
    asks = [Asks("log", 4, **c) for c in ({"evaluate": True}, {"save": True}, {})]
    ToyTrainer(toy_config(tmp_path, max_steps=16, log_every_n_steps=4),
               callbacks=[*asks, rec]).fit()
    assert rec.events[:9] == [("fit_start", 0)] + steps(1, 4) + [
        ("log", 4), ("validation_end", 4), ("checkpoint", 4), ("train_step_end", 5)]


class Duck:
    """A callback that does not subclass Callback: every event is its own."""

    def __init__(self):
        self.steps = []

    def on_train_step_end(self, view, output):
        self.steps.append(view.step)
        return Control(stop=True) if view.step == 3 else None

    def state_dict(self):
        return {}

    def __getattr__(self, name):  # the other events: nothing to do
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)


def test_the_step_event_reaches_every_callback_that_implements_it(tmp_path):
    # The loop hands on_train_step_end only to the callbacks that implement it (issue 37):
    # a subclass that overrides it, one that sets it on the instance, and a callback that
    # does not subclass Callback all get every step, in list order; the Controls are ORed.
    order = []

    class Own(Callback):
        def on_train_step_end(self, view, output):
            order.append(("own", view.step))

    class Plain(Callback):
        pass

    plain, instance, duck = Plain(), Plain(), Duck()
    instance.on_train_step_end = lambda view, output: order.append(("instance", view.step))
    ToyTrainer(toy_config(tmp_path, max_steps=10), callbacks=[plain, Own(), instance, duck]).fit()
    assert duck.steps == [1, 2, 3]  # its stop at step 3 ended the run
    assert order == [(who, s) for s in (1, 2, 3) for who in ("own", "instance")]
