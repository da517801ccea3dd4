"""Small pieces shared by the Triton kernel modules."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs

INTERPRETED: bool = bool(knobs.runtime.interpret)
"""Whether this process's kernels run in the Triton interpreter: `@triton.jit` reads TRITON_INTERPRET when
each kernel module is imported, which is when this (first-imported) module reads it too."""


@triton.jit
def softplus_clamp(v, lo, hi):
    """softplus with torch's threshold (20), then clamp to [lo, hi] (hi may be +inf)."""
    sp = tl.where(v > 20.0, v, tl.log(1.0 + tl.exp(tl.minimum(v, 20.0))))
    return tl.minimum(tl.maximum(sp, lo), hi)


@triton.jit
def mma(a, b, PREC: tl.constexpr):
    """tl.dot(a, b) with float32 result; PREC from `dot_precision` ("upcast": both operands to fp32)."""
    if PREC == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


def dot_precision(dtype: torch.dtype) -> str:
    """The `mma` mode for a model of `dtype`: exact ("ieee") for fp32, so fp32 results match the
    reference to ~1e-6; "tf32" otherwise (only the fp32 operands of a half-precision model use it;
    bf16/fp16 operands run on tensor cores in their own dtype). Under the Triton interpreter bf16
    operands are upcast: triton 3.9's interpreter multiplies the raw bits of bf16 tensors in tl.dot."""
    if dtype == torch.float32:
        return "ieee"
    if dtype == torch.bfloat16 and INTERPRETED:
        return "upcast"
    return "tf32"


def pow2(n: int, lo: int = 16) -> int:
    """Next power of two >= n, at least `lo` (tl.dot needs every dimension >= 16 on GPUs)."""
    return max(lo, triton.next_power_of_2(n))
