"""The threads plan (`trainer.num_threads`): how many threads torch computes with, chosen from
the cores this process may use, the processes on the node and the loader workers, so that they
do not fight over the same cores; and OpenMP told not to spin in a thread that has no core.

torch starts with one intra-op thread per core of the machine, whatever else runs there: under
torchrun each of N local processes, and each DataLoader worker, competes for the same cores,
and OpenMP's threads spin while they wait for one, burning the time another process needed.
`auto` gives each local process an equal share of this process's cores (`os.sched_getaffinity`,
which a container or `taskset` narrows), less the loader workers, at least one, and never more
than torch has already (a script's own `torch.set_num_threads(1)`, or a test harness's, stays).
A process alone on the node also leaves out the cores other work keeps busy at set-up (on Linux,
measured over 0.1 s from /proc/stat, this process's own time left out): a thread without a core
waits for one at every parallel region, so beside one busy process two threads on two cores
took 1.38x the time one took, while one thread on a quiet machine costs a few percent.
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
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

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
    share: int  # this process's share: cores / local processes - workers - busy, at least 1
    busy: int = 0  # cores other work kept busy at set-up (measured alone on the node only)


def plan_threads(setting: Any, environ: Mapping[str, str], cores: int, workers: int,
                 current: int, busy_elsewhere: Optional[Callable[[], float]] = None) -> ThreadPlan:
    """The plan for `trainer.num_threads` = `setting` ("auto" or a positive int), given the
    environment, the cores this process may use, the training loader's workers, the
    intra-op threads torch has now (`current`: auto never raises it) and `busy_elsewhere`,
    which measures the cores other work keeps busy (`busy_cores_elsewhere`): asked only when
    auto could choose more than one thread for a process alone on the node."""
    local = _positive_int(environ.get("LOCAL_WORLD_SIZE")) or 1
    share = max(1, cores // local - workers)
    facts = dict(cores=cores, local_processes=local, workers=workers, share=share)
    if setting != "auto":
        return ThreadPlan(int(setting), "trainer.num_threads", **facts)
    if _positive_int(environ.get("OMP_NUM_THREADS")):
        return ThreadPlan(None, "OMP_NUM_THREADS", **facts)
    if busy_elsewhere is not None and local == 1 and min(share, current) > 1:
        # (under torchrun the other ranks, busy starting up, would be taken for other work)
        busy = min(round(busy_elsewhere()), share - 1)
        facts.update(share=share - busy, busy=busy)
    return ThreadPlan(min(facts["share"], current), "auto", **facts)


def busy_cores_elsewhere(seconds: float = 0.1) -> float:
    """How many of this process's cores other processes kept busy over `seconds` (Linux's
    /proc/stat, this process's own CPU time left out); 0.0 where it cannot be read."""
    try:
        mine = {f"cpu{c}" for c in os.sched_getaffinity(0)}
        before, own = _cpu_times(mine), time.process_time()
        time.sleep(seconds)
        after, own = _cpu_times(mine), time.process_time() - own
    except (AttributeError, OSError, ValueError):  # not Linux: nothing known of other work
        return 0.0
    total = sum(a[0] - b[0] for a, b in zip(after, before))
    busy = sum(a[1] - b[1] for a, b in zip(after, before))
    if total <= 0:
        return 0.0
    return max(0.0, busy / total * len(mine) - own / seconds)


def _cpu_times(cpus: set[str]) -> list[tuple[int, int]]:
    """(all, busy) jiffies of each of `cpus`, in /proc/stat's order."""
    times = []
    with open("/proc/stat", encoding="ascii") as f:
        for line in f:
            name, *fields = line.split()
            if name in cpus:
                ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
                times.append((sum(ticks), sum(ticks) - ticks[3] - ticks[4]))
    return times


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
        why = (f"auto: {plan.cores} cores this process may use"
               + (f" - {plan.busy} busy with other work" if plan.busy else "")
               + f" / {plan.local_processes} "
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
