"""The process-wide CPU settings of a worker rank, applied once, before the model is built (`apply_host_settings`).

Every setting that holds for the whole process lives here, in the order it must be applied: subnormal floats
flushed (worker_proc.host.numerics; before any parallel region, so the threads torch starts inherit the mode),
torch's thread count (the largest the execution plan may choose, worker_proc.host.threads), oneDNN's primitive
caches capped (read once, at the first primitive), and the allocator's load policy (worker_proc.host.memory).
The one setting that changes later is the allocator's: `apply_steps_policy`, which the model runner calls
once the weights are loaded, before the execution plan is timed. On a GPU only the device is set.
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
    """What `apply_host_settings` decided: the thread counts a step may run on (empty off the CPU)."""

    thread_options: tuple[int, ...]


def apply_host_settings(args: ServerArgs, rank: int, device: str) -> HostSettings:
    """Apply the settings (see the module doc) for rank `rank` on `device`; call once per process."""
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    if device != "cpu":
        return HostSettings(())
    if not flush_denormals():
        logger.warning("rank %d: this CPU does not flush subnormal floats to zero", rank)
    options = thread_options(args, available_cores())
    torch.set_num_threads(max(options))
    capacity = onednn_cache_capacity(args.single_weight_copy)
    logger.info("rank %d: oneDNN primitive caches capped: %s", rank, bound_onednn_caches(capacity))
    if not map_load_blocks():
        logger.info("rank %d: the C library does not take the load's allocator policy", rank)
    return HostSettings(options)


def apply_steps_policy(rank: int) -> None:
    """Once the model is loaded (the CPU model runner calls it): the allocator's steps' policy, freed memory
    staying in the heap for the next step."""
    if keep_freed_memory():
        logger.info("rank %d: freed host memory of the steps stays in the heap (no page faults on each step's "
                    "temporaries)", rank)
