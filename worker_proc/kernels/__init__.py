"""Kernels of the model: the `KernelOps` interface, its implementations and their selection.

`worker_proc.kernels.interface` holds the contracts, `reference` the pure-torch ground truth (as
functions) and `reference_ops` its `KernelOps` form, `fast` the default CPU kernels, `triton_*` the
CUDA kernels, and `select` the rule that picks one per worker (`choose_kernels`, the kernel part of
the execution plan; `select_ops` builds its ops object).
"""

from __future__ import annotations

from worker_proc.kernels.fast import FastOps
from worker_proc.kernels.interface import KernelOps
from worker_proc.kernels.reference_ops import ReferenceOps
from worker_proc.kernels.select import KERNEL_CHOICES, select_ops

__all__ = ["KERNEL_CHOICES", "FastOps", "KernelOps", "ReferenceOps", "select_ops"]
