"""Which kernel implementation a worker runs: the one place that decides (`--kernels`).

Rules: `auto` is Triton on CUDA and `FastOps` on every other device; with
`--enable-deterministic-inference` it is the batch-invariant `ReferenceOps` on CPU (Triton stays on
CUDA: its kernels are batch invariant). An explicit choice is honoured or refused with a reason:
`fast` is not batch invariant, so it cannot serve the deterministic mode; `triton` needs triton and
a CUDA device (or the Triton interpreter, TRITON_INTERPRET=1, set before the kernels are imported).
CUDA without triton under `auto` falls back to the reference with a warning. Importing this module
never imports triton. The gated delta rule (Gated DeltaNet layers) runs flash-linear-attention's
kernels on CUDA when `fla` imports, else the pure-torch ones (`gdn_ops.gdn_backend`), under every choice.
"""

from __future__ import annotations

import logging

import torch

from worker_proc.kernels.fast import FastOps
from worker_proc.kernels.gdn_ops import gdn_backend
from worker_proc.kernels.interface import KernelOps
from worker_proc.kernels.reference_ops import ReferenceOps

logger = logging.getLogger(__name__)

KERNEL_CHOICES = ("auto", "reference", "fast", "triton")


def select_ops(device: torch.device | str, choice: str = "auto", deterministic: bool = False) -> KernelOps:
    """The ops object for tensors on `device`. Raises ValueError naming the problem for an unknown
    or impossible `choice`."""
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"unknown kernel implementation {choice!r}: expected one of {', '.join(KERNEL_CHOICES)}")
    dev = torch.device(device)
    if choice == "fast" and deterministic:
        raise ValueError("--kernels fast is not batch invariant: it cannot serve --enable-deterministic-inference")
    if choice == "reference" or (choice == "auto" and dev.type != "cuda" and deterministic):
        return ReferenceOps(batch_invariant=deterministic or dev.type == "cpu", gdn=gdn_backend(dev))
    if choice == "fast" or (choice == "auto" and dev.type != "cuda"):
        return FastOps(gdn=gdn_backend(dev, fast=True))
    try:
        from worker_proc.kernels import triton_common  # imports triton: only when Triton is chosen
        from worker_proc.kernels.triton_ops import TritonOps
    except ImportError as exc:
        if choice == "triton":
            raise ValueError(f"Triton kernels requested but triton cannot be imported: {exc}") from exc
        logger.warning("triton cannot be imported (%s): the pure-torch reference kernels run on %s", exc, dev)
        return ReferenceOps(batch_invariant=deterministic, gdn=gdn_backend(dev))
    if dev.type != "cuda" and not triton_common.INTERPRETED:
        raise ValueError(f"Triton kernels on device {dev} need TRITON_INTERPRET=1 when the kernels are imported")
    return TritonOps(gdn=gdn_backend(dev))
