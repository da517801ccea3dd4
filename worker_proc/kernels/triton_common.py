"""Small pieces shared by the Triton kernel modules (owned by the Triton kernel path, helper E)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def softplus_clamp(v, lo, hi):
    """softplus with torch's threshold (20), then clamp to [lo, hi] (hi may be +inf)."""
    sp = tl.where(v > 20.0, v, tl.log(1.0 + tl.exp(tl.minimum(v, 20.0))))
    return tl.minimum(tl.maximum(sp, lo), hi)


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: exact ("ieee") for fp32 models, so fp32 results match the reference to
    ~1e-6; tf32 for the fp32 operands of a half-precision model (bf16/fp16 operands ignore it)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def pow2(n: int, lo: int = 16) -> int:
    """Next power of two >= n, at least `lo` (tl.dot needs every dimension >= 16 on GPUs)."""
    return max(lo, triton.next_power_of_2(n))
