"""The threads plan (`trainer.num_threads`): how many threads torch computes with, chosen from
the cores this process may use, the processes on the node and the loader workers, so that they
do not fight over the same cores; and OpenMP told not to spin in a thread that has no core.

torch starts with one intra-op thread per core of the machine, whatever else runs there: under
torchrun each of N local processes, and each DataLoader worker, competes for the same cores,
and OpenMP's threads spin while they wait for one, burning the time another process needed.
`auto` gives each local process an equal share of this process's cores (`os.sched_getaffinity`,
which a container or `taskset` narrows), less the loader workers, at least one, and never more
than torch has already (a script's own `torch.set_num_threads(1)`, or a test harness's, stays).
An explicit `trainer.num_threads` wins, and so does the user's own OMP_NUM_THREADS (torch
already took it at start-up: saferun leaves it).

OpenMP reads its wait policy once, when its runtime is loaded (torch's libgomp, at
`import torch`): the `saferun` command sets OMP_WAIT_POLICY=PASSIVE before it imports torch,
unless the environment has one. In a script that imported torch itself it is too late; the
plan says so. No torch import at module level: the command calls `prepare_openmp` first.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, Mapping, Optional

log = logging.getLogger("saferun")

WAIT_POLICY = "PASSIVE"
_set_by_saferun = [False]  # prepare_openmp set OMP_WAIT_POLICY in this process


@dataclass(frozen=True)
class ThreadPlan:
    """What `plan_threads` chose, and why."""

    threads: Optional[int]  # intra-op threads to set; None: leave torch's (OMP_NUM_THREADS)
    source: str  # "trainer.num_threads", "OMP_NUM_THREADS" or "auto"
    cores: int  # cores this process may use
    local_processes: int  # processes of this job on the node (torchrun's LOCAL_WORLD_SIZE)
    workers: int  # loader workers computing beside the step
    share: int  # this process's share: cores / local processes - workers, at least 1


def plan_threads(setting: Any, environ: Mapping[str, str], cores: int, workers: int,
                 current: int) -> ThreadPlan:
    """The plan for `trainer.num_threads` = `setting` ("auto" or a positive int), given the
    environment, the cores this process may use, the training loader's workers and the
    intra-op threads torch has now (`current`: auto never raises it)."""
    local = _positive_int(environ.get("LOCAL_WORLD_SIZE")) or 1
    share = max(1, cores // local - workers)
    facts = dict(cores=cores, local_processes=local, workers=workers, share=share)
    if setting != "auto":
        return ThreadPlan(int(setting), "trainer.num_threads", **facts)
    if _positive_int(environ.get("OMP_NUM_THREADS")):
        return ThreadPlan(None, "OMP_NUM_THREADS", **facts)
    return ThreadPlan(min(share, current), "auto", **facts)


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (macOS, Windows: no affinity mask)
        return os.cpu_count() or 1


def apply_plan(plan: ThreadPlan) -> str:
    """Set torch's threads per `plan` and return the one line that says what and why."""
    import torch

    if plan.threads is not None:
        torch.set_num_threads(plan.threads)
        if torch.get_num_interop_threads() != plan.threads:
            try:  # only possible before the inter-op pool started (once per process)
                torch.set_num_interop_threads(plan.threads)
            except RuntimeError:
                pass  # (said below: the inter-op count is read back)
    threads, interop = torch.get_num_threads(), torch.get_num_interop_threads()
    if plan.source == "auto":
        why = (f"auto: {plan.cores} cores this process may use / {plan.local_processes} "
               f"process{'es' if plan.local_processes > 1 else ''} on the node - {plan.workers} "
               f"loader worker{'s' if plan.workers != 1 else ''} = {plan.share}"
               + (", no more than torch had" if plan.threads is not None and plan.threads < plan.share
                  else "") + "; trainer.num_threads chooses")
    elif plan.source == "OMP_NUM_THREADS":
        why = f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} from the environment wins"
    else:
        why = "trainer.num_threads"
    return f"threads: {threads} intra-op, {interop} inter-op ({why}); {wait_policy()}"


def wait_policy() -> str:
    """What OpenMP's idle threads do, as far as saferun can tell."""
    policy = os.environ.get("OMP_WAIT_POLICY")
    if _set_by_saferun[0]:
        return f"OpenMP threads sleep when idle (OMP_WAIT_POLICY={policy}, set by saferun)"
    if policy:
        return f"OpenMP wait policy OMP_WAIT_POLICY={policy} from the environment"
    return ("OpenMP threads spin a while when idle (torch was imported before saferun could "
            "choose; set OMP_WAIT_POLICY=PASSIVE in the environment so that a thread without a "
            "core does not spin)")


def prepare_openmp(environ: Optional[dict[str, str]] = None) -> None:
    """Before torch is imported (the `saferun` command calls it first): OMP_WAIT_POLICY=PASSIVE
    unless the environment sets one, so that an idle OpenMP thread sleeps instead of spinning
    on a core another thread or process needs. Too late once torch is imported: nothing then."""
    env = os.environ if environ is None else environ
    if "torch" in sys.modules or "OMP_WAIT_POLICY" in env:
        return
    env["OMP_WAIT_POLICY"] = WAIT_POLICY
    _set_by_saferun[0] = environ is None


def _positive_int(value: Optional[str]) -> Optional[int]:
    try:
        n = int(value) if value is not None else None
    except ValueError:
        return None
    return n if n is not None and n > 0 else None
