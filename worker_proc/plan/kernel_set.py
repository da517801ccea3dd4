"""Which kernel set a worker's mixers run: the kernel part of its execution plan (`--kernels`).

Rules: `auto` is Triton on CUDA, `NativeOps` (`FastOps` with the Mamba layers' and the norms' fused C++
kernels, worker_proc.kernels.native) on the CPU, falling back to `FastOps` with a warning where they cannot be
built, and `FastOps` on every other device; with
`--enable-deterministic-inference` it is the batch-invariant `ReferenceOps` on CPU (Triton stays on
CUDA: its kernels are batch invariant). An explicit choice is honoured or refused with a reason:
`fast` is not batch invariant, so it cannot serve the deterministic mode; `triton` needs triton and
a CUDA device (or the Triton interpreter, TRITON_INTERPRET=1, set before the kernels are imported);
`native` needs the CPU and a build of the fused kernels.
CUDA without triton under `auto` falls back to the reference with a warning. `reference` is batch
invariant exactly in the deterministic mode. Importing this module never imports triton. The gated
delta rule (Gated DeltaNet layers) runs flash-linear-attention's kernels on CUDA when `fla` imports,
its fused CPU decode step under `native`, else the pure-torch ones (`gdn_ops.gdn_choice`); Kimi Delta
Attention's per-channel rule runs flash-linear-attention's KDA kernels on CUDA when they import, its fused
CPU decode step and prefill under `native`, else the pure-torch one (`kda_ops.kda_choice`). Prefill
segments: the reference and Triton sets give every segment its own computation (one varlen call on
Triton); `fast` pads Mamba's conv and scan segments into one batched call where `segments.batchable`
says it pays (padded attention and gated-delta prefill were slower on CPU than one call per segment).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from worker_proc.kernels import native
from worker_proc.kernels.fast import FastOps
from worker_proc.kernels.gdn_ops import gdn_choice, make_gdn
from worker_proc.kernels.interface import KernelOps
from worker_proc.kernels.kda_ops import FlaKda, ReferenceKda, kda_choice
from worker_proc.kernels.reference_ops import ReferenceOps
from worker_proc.kernels.segments import PAD_SLACK

logger = logging.getLogger(__name__)

KERNEL_CHOICES = ("auto", "reference", "fast", "native", "triton")


@dataclass(frozen=True)
class KernelChoice:
    """The kernel set (`ops`: reference | fast | native | triton), whether it is batch invariant, and the gated
    delta backend (`gdn`: reference | fast | native | fla; empty for a model without Gated DeltaNet layers, whose
    ops then hold the pure-torch one unused); `fallback`: why a weaker set runs, if one does; `kda`: the KDA
    backend (reference | native | fla; empty without Kimi Delta Attention layers)."""

    ops: str
    batch_invariant: bool
    gdn: str
    fallback: str = ""
    kda: str = ""  # the KDA backend (reference | native | fla; empty for a model without Kimi Delta Attention layers)

    def prefill_rule(self) -> str:
        if self.ops == "native":
            return ("Mamba conv and scan, and Kimi Delta Attention: every segment in one call from its own state, "
                    "unpadded; attention and gated-delta segments one call each")
        if self.ops == "fast":
            return (f"Mamba prefill segments batched when padding costs <= {PAD_SLACK}x rows, else one call each; "
                    "attention and gated-delta segments one call each")
        if self.ops == "triton":
            return "prefill segments in one varlen call"
        return "prefill segments one call each"

    @property
    def verify_by_token(self) -> bool:
        """Whether a slice verifying drafts runs as one decode group per position (the decode kernels'
        numbers: bitwise those of decoding without drafts, which a batch-invariant set promises) rather
        than as one prefill segment."""
        return self.batch_invariant

    def describe(self) -> str:
        mode = "batch invariant" if self.batch_invariant else "not batch invariant"
        extra = f"; {self.fallback}" if self.fallback else ""
        gdn = f", gated delta rule: {self.gdn}" if self.gdn else ""
        kda = f", per-channel delta rule: {self.kda}" if self.kda else ""
        verify = "drafts verified token by token" if self.verify_by_token else "drafts verified as a prefill segment"
        return f"kernels: {self.ops} ({mode}; {self.prefill_rule()}; {verify}){gdn}{kda}{extra}"

    def build(self) -> KernelOps:
        ops = self._build_ops()
        if self.kda:
            ops.kda = _kda_backend(self.kda)  # type: ignore[attr-defined]
        return ops

    def _build_ops(self) -> KernelOps:
        if self.ops == "native":
            from worker_proc.kernels.native.ops import NativeGdn, NativeOps

            return NativeOps(gdn=NativeGdn() if self.gdn == "native" else make_gdn(self.gdn or "reference"))
        gdn = make_gdn(self.gdn or "reference")
        if self.ops == "fast":
            return FastOps(gdn=gdn)
        if self.ops == "triton":
            from worker_proc.kernels.triton.ops import TritonOps  # imports triton: only when Triton is chosen

            return TritonOps(gdn=gdn)
        return ReferenceOps(batch_invariant=self.batch_invariant, gdn=gdn)


def choose_kernels(device: torch.device | str, choice: str = "auto", deterministic: bool = False,
                   has_gdn: bool = True, has_kda: bool = False) -> KernelChoice:
    """The kernel set for tensors on `device` (`has_gdn`: the model has Gated DeltaNet layers; `has_kda`:
    Kimi Delta Attention layers, whose backend is `kda_ops.kda_choice`'s). Raises ValueError naming the
    problem for an unknown or impossible `choice`."""
    chosen = _choose(device, choice, deterministic, has_gdn)
    return replace(chosen, kda=kda_choice(device, native=chosen.ops == "native")) if has_kda else chosen


def _choose(device: torch.device | str, choice: str, deterministic: bool, has_gdn: bool) -> KernelChoice:
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"unknown kernel implementation {choice!r}: expected one of {', '.join(KERNEL_CHOICES)}")
    dev = torch.device(device)

    def gdn(d: torch.device, fast: bool = False) -> str:
        return gdn_choice(d, fast) if has_gdn else ""

    if choice == "reference" or (choice == "auto" and dev.type != "cuda" and deterministic):
        return KernelChoice("reference", deterministic, gdn(dev))
    if choice in ("fast", "native") and deterministic:
        raise ValueError(f"--kernels {choice} is not batch invariant: it cannot serve --enable-deterministic-inference")
    if choice == "native" or (choice == "auto" and dev.type == "cpu"):
        if dev.type != "cpu":
            raise ValueError(f"--kernels native runs on the CPU, not on {dev}")
        if native.load():
            return KernelChoice("native", False, "native" if has_gdn else "")
        if choice == "native":
            raise ValueError(f"--kernels native: the fused CPU kernels could not be built ({native.load_error()})")
        return KernelChoice("fast", False, gdn(dev, fast=True),
                            f"the fused CPU kernels could not be built ({native.load_error()})")
    if choice == "fast" or (choice == "auto" and dev.type != "cuda"):
        return KernelChoice("fast", False, gdn(dev, fast=True))
    try:  # imports triton: only when Triton is chosen
        from worker_proc.kernels.triton import common as triton_common
        from worker_proc.kernels.triton.ops import TritonOps  # noqa: F401  (importable: `build` needs it)
    except ImportError as exc:
        if choice == "triton":
            raise ValueError(f"Triton kernels requested but triton cannot be imported: {exc}") from exc
        logger.warning("triton cannot be imported (%s): the pure-torch reference kernels run on %s", exc, dev)
        return KernelChoice("reference", deterministic, gdn(dev), f"triton cannot be imported ({exc})")
    if dev.type != "cuda" and not triton_common.INTERPRETED:
        raise ValueError(f"Triton kernels on device {dev} need TRITON_INTERPRET=1 when the kernels are imported")
    return KernelChoice("triton", True, gdn(dev))


def select_ops(device: torch.device | str, choice: str = "auto", deterministic: bool = False) -> KernelOps:
    """The ops object of `choose_kernels`."""
    return choose_kernels(device, choice, deterministic).build()


def _kda_backend(name: str) -> object:
    """The Kimi Delta Attention backend `kda_choice` named (`native` only where the native kernel set runs,
    its library loaded)."""
    if name == "native":
        from worker_proc.kernels.native.ops import NativeKda

        return NativeKda()
    return {"reference": ReferenceKda, "fla": FlaKda}[name]()
