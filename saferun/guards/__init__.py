"""Guards: the checks that make a wrong result fail loudly (bad steps, spikes, buffers, eval
purity, DataLoader preflight, anomaly replay, host-sync audit, the first step's audits).
Explaining a failure after the fact is `saferun.diagnose`; the `saferun check` engine is
`saferun.check`."""

from typing import Any


def __getattr__(name: str) -> Any:  # `saferun.guards.NAME` after `import saferun` alone
    from .. import submodule

    return submodule(__name__, name)
