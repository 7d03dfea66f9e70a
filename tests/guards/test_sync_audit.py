"""Guard 8: the host-sync audit names each line that reads the device, per step, with its cost."""

import os

import torch

import saferun
from saferun.guards.sync_audit import audit, format_audit
from saferun.guards.syncs import HostSyncCounter

SAFERUN_FILE = os.path.join(os.path.dirname(saferun.__file__), "trainer.py")
LIBRARY_FILE = os.path.join(os.path.dirname(torch.__file__), os.pardir, "tqdm", "std.py")


def chatty_steps(n: int) -> list[dict[str, int]]:
    """A hand-written loop that reads the loss every step and the weights every 5th step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.Adam(model.parameters())  # its host-side step counters are not syncs
    counter, steps = HostSyncCounter(), []
    for i in range(n):
        counter.reset()
        with counter:
            loss = model(torch.randn(8, 4)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            last = loss.detach().item()  # SYNC-EVERY-STEP
            if i % 5 == 0:
                norm = float(model.weight.detach().norm())  # SYNC-EVERY-5
        steps.append(dict(counter.sites))
    return steps


def line_of(marker: str) -> str:
    with open(__file__) as f:
        number = next(i for i, line in enumerate(f, 1) if line.rstrip().endswith(marker))
    return f"{__file__}:{number}"


def test_each_user_line_is_named_with_its_syncs_per_step_and_source():
    sites = audit(chatty_steps(10))
    assert [(s.site, s.origin, s.total, s.steps_with, s.per_step) for s in sites] == [
        (line_of("SYNC-EVERY-STEP"), "user", 10, 10, 1.0),
        (line_of("SYNC-EVERY-5"), "user", 2, 2, 0.2),
    ]
    assert sites[0].code == "last = loss.detach().item()  # SYNC-EVERY-STEP"


def test_report_shows_rate_line_code_advice_and_cost():
    text = format_audit(chatty_steps(10), device_type="cuda")
    lines = text.splitlines()
    assert lines[0] == "Host syncs: 1.20 per training step over 10 steps."
    assert lines[1] == (f"   1.00/step  {line_of('SYNC-EVERY-STEP')}  [user]  "
                        f"last = loss.detach().item()  # SYNC-EVERY-STEP")
    assert lines[2].startswith(f"   0.20/step  {line_of('SYNC-EVERY-5')}  [user]")
    assert lines[3].startswith("  user lines: keep the value on the device")
    assert "wait until the GPU has finished all the work queued so far" in lines[4]
    assert "costs little" in format_audit(chatty_steps(2), device_type="cpu")


def test_sites_are_attributed_to_saferun_a_library_or_unknown():
    steps = [{f"{SAFERUN_FILE}:300": 1, f"{os.path.normpath(LIBRARY_FILE)}:12": 2, "<unknown>": 1},
             {}]
    origins = {s.site.rsplit(":", 1)[0]: (s.origin, s.per_step) for s in audit(steps)}
    assert origins == {SAFERUN_FILE: ("saferun", 0.5),
                       os.path.normpath(LIBRARY_FILE): ("library", 1.0),
                       "<unknown>": ("unknown", 0.5)}
    text = format_audit(steps)
    assert "library lines:" in text and "unknown lines:" in text and "user lines:" not in text


def test_a_step_without_syncs_says_so():
    assert format_audit([{}, {}]) == ("Host syncs: 0.00 per training step over 2 steps. "
                                      "None: the step never waits for the device.")
