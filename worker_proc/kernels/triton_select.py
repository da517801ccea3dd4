"""`select_ops`: which kernel implementation a worker uses (importing this module never imports triton).

Owned by the Triton kernel path (helper E); `worker_proc.kernels.get_ops` delegates here. CUDA
tensors get `TritonOps`, every other device `ReferenceOps`; `force` ("triton" | "reference", from the
HYSSM_KERNELS environment variable) overrides the device for debugging. The reference is built
exactly as `get_ops` builds it (batch invariant on CPU, batched elsewhere). Triton on a non-CUDA device
only works under the Triton interpreter (TRITON_INTERPRET=1 while the kernel modules are imported).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from worker_proc.kernels import KernelOps

logger = logging.getLogger(__name__)

KERNEL_CHOICES = ("reference", "triton")


def select_ops(device: torch.device | str, force: str | None = None) -> KernelOps:
    """The ops object for tensors on `device`. Raises ValueError for an unknown `force`, for
    `force="triton"` when triton cannot be imported, or on a non-CUDA device when the kernels were not
    built interpreted (they could not run). CUDA without triton falls back to the reference (warning)."""
    from worker_proc.kernels import ReferenceOps  # lazy: the package may import this module

    if force not in (None, "", *KERNEL_CHOICES):
        raise ValueError(f"unknown kernel implementation {force!r}: expected one of {KERNEL_CHOICES}")
    dev = torch.device(device)
    if force == "reference" or (force != "triton" and dev.type != "cuda"):
        return ReferenceOps(batch_invariant=dev.type == "cpu")
    try:
        from worker_proc.kernels import triton_common  # imports triton: only when Triton is chosen
        from worker_proc.kernels.triton_ops import TritonOps
    except ImportError as exc:
        if force == "triton":
            raise ValueError(f"Triton kernels requested but triton cannot be imported: {exc}") from exc
        logger.warning("triton cannot be imported (%s): the pure-torch reference kernels run on %s", exc, dev)
        return ReferenceOps(batch_invariant=dev.type == "cpu")
    if dev.type != "cuda" and not triton_common.INTERPRETED:
        raise ValueError(f"Triton kernels on device {dev} need TRITON_INTERPRET=1 when the kernels are imported")
    return TritonOps()  # type: ignore[return-value]  # same methods and signatures as ReferenceOps
