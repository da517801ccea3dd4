"""Which torch thread counts a CPU worker rank may run its steps on (`thread_options`).

The rank's share of the node's cores is every core divided by the ranks on the node (those of every
--dp-size replica together): more OpenMP threads than cores spin against each other and make GEMMs
many times slower. Within the share, the execution plan measures which count each step size runs
fastest on (worker_proc.plan.execution_plan): one thread or the whole share. `--cpu-threads N` fixes every
step at N, and the deterministic mode runs every step on the whole share.
"""

from __future__ import annotations

import os

from shared.config import ServerArgs


def core_share(args: ServerArgs, cores: int) -> int:
    """This rank's share of the node's cores (at least one)."""
    return max(1, cores // (args.ranks_per_node * args.dp_size))


def thread_options(args: ServerArgs, cores: int) -> tuple[int, ...]:
    """The thread counts the plan chooses among (see the module doc)."""
    if args.cpu_threads > 0:
        return (args.cpu_threads,)
    share = core_share(args, cores)
    if args.enable_deterministic_inference or share == 1:
        return (share,)
    return (1, share)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
