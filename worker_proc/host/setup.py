"""The process-wide CPU settings of a worker rank, applied once, before the model is built (`apply_host_settings`).

Every setting that holds for the whole process lives here, in the order it must be applied: subnormal floats
flushed (worker_proc.host.numerics; before any parallel region, so the threads torch starts inherit the mode),
torch's thread count (the largest the execution plan may choose, worker_proc.host.threads), oneDNN's primitive
caches capped (read once, at the first primitive), and the allocator's load policy (worker_proc.host.memory;
`keep_freed_memory` switches it to the steps' policy once the model is loaded). On a GPU only the device is set.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from shared.config import ServerArgs
from worker_proc.host.memory import bound_onednn_caches, keep_freed_memory, map_load_blocks, onednn_cache_capacity
from worker_proc.host.numerics import flush_denormals
from worker_proc.host.threads import available_cores, thread_options

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HostSettings:
    """What `apply_host_settings` decided: the thread counts a step may run on (empty off the CPU) and
    whether the load's blocks are mappings of their own."""

    thread_options: tuple[int, ...]
    load_blocks_mapped: bool


def apply_host_settings(args: ServerArgs, rank: int, device: str) -> HostSettings:
    """Apply the settings (see the module doc) for rank `rank` on `device`; call once per process."""
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    if device != "cpu":
        return HostSettings((), False)
    if not flush_denormals():
        logger.warning("rank %d: this CPU does not flush subnormal floats to zero", rank)
    options = thread_options(args, available_cores())
    torch.set_num_threads(max(options))
    capacity = onednn_cache_capacity(args.single_weight_copy)
    logger.info("rank %d: oneDNN primitive caches capped: %s", rank, bound_onednn_caches(capacity))
    return HostSettings(options, map_load_blocks())


def apply_steps_policy(rank: int, host: HostSettings) -> None:
    """Once the model is loaded: the allocator's steps' policy (freed memory stays in the heap)."""
    if keep_freed_memory():
        logger.info("rank %d: the load's blocks were their own mappings (%s); freed host memory of the steps "
                    "stays in the heap (no page faults on each step's temporaries)", rank,
                    "freed whole" if host.load_blocks_mapped else "not applied")
