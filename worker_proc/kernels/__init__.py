"""Kernels of the model: the `KernelOps` interface and its implementations.

`worker_proc.kernels.interface` holds the contracts, `reference` the pure-torch ground truth (as
functions) and `reference_ops` its `KernelOps` form, `fast` the default CPU kernels, `native` the fused
C++ CPU kernels, `triton/` the CUDA kernels. Which set a worker runs is the execution plan's
(`worker_proc.plan.kernel_set`).
"""

from __future__ import annotations

from worker_proc.kernels.fast import FastOps
from worker_proc.kernels.interface import KernelOps
from worker_proc.kernels.reference_ops import ReferenceOps

__all__ = ["FastOps", "KernelOps", "ReferenceOps"]
