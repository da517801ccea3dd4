"""What the kernel tests share: the tolerance, seeded inputs and pools (slot 0 zero), strided
views, cu_seqlens, and checks that a kernel wrote only the slots it was given."""

from __future__ import annotations

import torch

TOL = 1e-4
"""fp32 tolerance of every kernel against the reference (acceptance criterion of issue 8)."""


def rand(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def pool(gen: torch.Generator, slots: int, *shape: int, zero: tuple[int, ...] = (), dtype: torch.dtype = torch.float32):
    """A pool [slots + 1, *shape] of random states, slot 0 (padding) and slots in `zero` all zeros."""
    out = rand(gen, slots + 1, *shape, dtype=dtype)
    out[0] = 0
    for s in zero:
        out[s] = 0
    return out


def strided(x: torch.Tensor, pad: int = 3) -> torch.Tensor:
    """The same values as `x` [T, ...] but a non-contiguous view (as the model's split projections are)."""
    wide = torch.zeros(x.shape[0], *x.shape[1:-1], x.shape[-1] + 2 * pad, dtype=x.dtype)
    wide[..., pad : pad + x.shape[-1]] = x
    return wide[..., pad : pad + x.shape[-1]]


def cu_seqlens(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def untouched(before: torch.Tensor, after: torch.Tensor, written: list[int]) -> bool:
    """True when every pool row outside `written` (slot 0 included) is bit-identical."""
    keep = [s for s in range(before.shape[0]) if s not in written]
    return bool(torch.equal(before[keep], after[keep]))
