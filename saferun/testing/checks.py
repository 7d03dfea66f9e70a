"""The `saferun check` report, host syncs and determinism as tests (saferun.check does the work)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from ..check import STEPS, format_report, run_checks, step_syncs
from ..guards.sync_audit import audit, format_audit
from .jobs import Job, fail, one_thread, work_dir


def assert_checks_pass(job: Job, warn_ok: Sequence[str] = (), only: Optional[Sequence[str]] = None,
                       **trainer: Any) -> None:
    """Every check of `saferun check` passes; those named in `warn_ok` may warn.

    The checks (each runs a fresh Trainer for 8 steps, as `saferun check` does): pickling,
    worker seeding, eval purity, declared modes, unused parameters, host syncs, one-batch
    overfit, determinism, data overlap, initial loss, batch independence, input baseline
    (and compile parity with `trainer.compile`). `only` runs some of
    them; `trainer` overrides `trainer.` settings for the runs (e.g. `num_workers=2`).
    """
    with one_thread(), work_dir(None, "saferun-checks-") as tmp:
        results = run_checks(job.factory(), job.short(tmp, **trainer), only=only)
    bad = [r for r in results if r.status == "fail" or (r.status == "warn" and r.name not in warn_ok)]
    if bad:
        fail(f"saferun check of {job.name}: {', '.join(r.name for r in bad)} did not pass "
             f"(warnings allowed: {', '.join(warn_ok) or 'none'}):\n{format_report(results)}")


def assert_no_host_syncs(job: Job, steps: int = STEPS, allow: Sequence[str] = (),
                         **trainer: Any) -> None:
    """No training step reads a tensor's value into Python (`.item()`, `float(t)`, `if t:`,
    `.tolist()`, ...): the steps between log points never wait for the device.

    Runs `steps` steps of a fresh Trainer under `saferun.guards.syncs.HostSyncCounter` and
    fails naming each line that synced, with its code. `allow`: substrings of a site
    ("mymodel.py:42") or of its code that may sync.
    """
    with one_thread(), work_dir(None, "saferun-syncs-") as tmp:
        t = job.build(job.short(tmp, max_steps=steps, **trainer))
        t.setup()
        per_step = step_syncs(t)
    kept = [{site: n for site, n in sites.items() if not _allowed(site, allow)} for sites in per_step]
    if any(kept):
        fail(f"host syncs in {job.name}'s training steps (between log points, where saferun "
             f"itself reads nothing):\n{format_audit(kept, 'cuda')}")


def _allowed(site: str, allow: Sequence[str]) -> bool:
    if not allow:
        return False
    code = audit([{site: 1}])[0].code
    return any(a in site or (code and a in code) for a in allow)


def assert_deterministic(job: Job, **trainer: Any) -> None:
    """Two 8-step runs with one seed end with identical weights, and two DataLoader workers
    draw different random augmentations of one sample (the `determinism` and `worker seeding`
    checks of `saferun check`). `trainer` overrides `trainer.` settings, e.g.
    `num_workers=2` to train with workers too."""
    with one_thread(), work_dir(None, "saferun-determinism-") as tmp:
        results = run_checks(job.factory(), job.short(tmp, **trainer),
                             only=["worker seeding", "determinism"])
    bad = [r for r in results if r.status != "pass"]
    if bad:
        fail(f"{job.name} is not reproducible:\n" + "\n".join(str(r) for r in bad))
