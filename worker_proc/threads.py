"""How many torch threads a CPU worker rank runs each step with (`StepThreads`, `cpu_threads`).

The rank's share of the node's cores is every core divided by the ranks on the node (those of every
--dp-size replica together): more OpenMP threads than cores spin against each other and make GEMMs
many times slower. A large model uses its whole share on every step. A small one (hidden size under
`SMALL_MODEL_HIDDEN`) runs its short decode steps on one thread, whose work is too brief to amortise
waking a second one, and its large steps (at least `LARGE_STEP_ROWS` token rows: batched prompts) on
the whole share, where the GEMMs are long enough to split (measured on the built-in model, 2 cores:
32 prompts of 128 tokens in one step 426 ms on one thread, 288 ms on two; a decode step is slower on two).
`--cpu-threads N` fixes every step at N.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from shared.config import ServerArgs

SMALL_MODEL_HIDDEN = 512
"""Below this hidden size a decode step's GEMMs are too small to split across threads."""
LARGE_STEP_ROWS = 256
"""A step with at least this many token rows counts as large (see the module doc)."""


@dataclass(frozen=True)
class StepThreads:
    """Torch threads for a step of fewer than `LARGE_STEP_ROWS` rows (`small`) and for larger ones."""

    small: int
    large: int

    def __post_init__(self) -> None:
        if self.small < 1 or self.large < 1:
            raise ValueError(f"thread counts must be >= 1, got small={self.small} large={self.large}")

    def for_rows(self, rows: int) -> int:
        return self.large if rows >= LARGE_STEP_ROWS else self.small

    def apply(self, rows: int) -> None:
        """Set torch's intra-op thread count for a step of `rows` token rows (a no-op when unchanged)."""
        n = self.for_rows(rows)
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)


def cpu_threads(args: ServerArgs, cores: int, hidden_size: int) -> StepThreads:
    """The rank's step threads (see the module doc)."""
    if args.cpu_threads > 0:
        return StepThreads(args.cpu_threads, args.cpu_threads)
    share = max(1, cores // (args.ranks_per_node * args.dp_size))
    return StepThreads(1 if hidden_size < SMALL_MODEL_HIDDEN else share, share)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
