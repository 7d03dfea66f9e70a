"""Real torchrun (2 processes, gloo, FSDP): a rank that dies while a checkpoint is written is
reported by the survivor as another rank's death, not as a disk that could not be written."""

import pytest

from test_fsdp import job_config, torchrun


@pytest.mark.slow  # one FSDP launch (about 15 s)
def test_a_rank_killed_during_a_save_is_reported_as_a_dead_rank(tmp_path):
    proc = torchrun(job_config(tmp_path / "run"), {"die_in_save": True})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "a collective with the other ranks failed during the save" in proc.stderr, out[-6000:]
    assert "Another rank most likely died" in proc.stderr
    assert "keep_last=K needs room" not in out  # not advice about disk space
