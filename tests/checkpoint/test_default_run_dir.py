"""A Trainer given no trainer.run_dir gets a directory of its own, however quickly the next follows."""

import time

from toys import ToyTrainer, toy_config


def pair_set_up_within_one_second(tmp_path):
    """Two Trainers set up (which chooses the run directory) within one wall-clock second."""
    for _ in range(10):
        start = int(time.time())
        pair = [ToyTrainer(toy_config(tmp_path, max_steps=2, run_dir=None)) for _ in range(2)]
        for t in pair:
            t.setup()
        if int(time.time()) == start:
            return pair
    raise AssertionError("could not set up two Trainers within one second")


def test_fits_started_within_a_second_get_their_own_directories(tmp_path, monkeypatch):
    """A loop of short fits (an lr loop, k folds): the default runs/<time> named the same
    directory twice within a second, and the second fit was refused."""
    monkeypatch.chdir(tmp_path)
    pair = pair_set_up_within_one_second(tmp_path)
    dirs = [t.state.run_dir for t in pair]
    assert dirs[0] != dirs[1], dirs
    for t in pair:
        t.fit()  # neither refused
    assert all((tmp_path / d / "checkpoints" / "step-00000002").is_dir() for d in dirs)
