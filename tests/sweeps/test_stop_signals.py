"""trainer.stop_signals: a signal added there (the one a cluster sends before the time limit)
stops training at a step boundary with a checkpoint, as SIGTERM does; others are refused."""

import signal

import pytest

from saferun import load_config
from saferun.checkpoint import list_checkpoints, load_checkpoint
from saferun.errors import ConfigError
from saferun.preemption import Preempted
from sweep_toys import SignalAt
from toys import ToyTrainer, toy_config


def test_an_added_signal_stops_at_a_step_boundary_with_a_checkpoint(tmp_path):
    cfg = toy_config(tmp_path, save_every_n_steps=None, stop_signals=["SIGTERM", "SIGINT", "SIGUSR1"])
    trainer = ToyTrainer(cfg, callbacks=[SignalAt([7], "SIGUSR1")])
    previous = signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # were it not listened to: ignored
    try:
        with pytest.raises(Preempted) as stop:
            trainer.fit()
        # the process's handler again once fit has returned
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert stop.value.code == 128 + signal.SIGUSR1 and "stopped by SIGUSR1 at step 7" in str(stop.value)
    saved = list_checkpoints(tmp_path / "run" / "checkpoints")
    assert [p.name for p in saved] == ["step-00000007"]
    assert load_checkpoint(saved[0])["loop"]["step"] == 7


@pytest.mark.parametrize("signals", [["SIGTERM", "SIGINT", "SIGKILL"], ["SIGTERM"], ["SIGUSR3"]])
def test_stop_signals_must_keep_sigterm_and_sigint_and_name_catchable_ones(signals):
    with pytest.raises(ConfigError, match=r"trainer.stop_signals must hold SIGTERM and SIGINT, and "
                                          r"may add SIGUSR1, SIGUSR2, SIGHUP; got"):
        load_config({"trainer": {"stop_signals": signals}})
