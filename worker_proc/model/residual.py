"""`Residual`: the residual stream of one forward between sublayers. A sublayer's output is held back
until the next norm reads the stream, which adds it in the same pass (`KernelOps.add_rms_norm`): one
read of the stream per sublayer instead of an add and then a norm.

A family with `HybridConfig.residual_fp32` (Mamba / FalconMamba `residual_in_fp32`) has the stream carried
in float32 in a 16-bit model, as transformers' Mamba blocks do: every sublayer output (in the model dtype)
is added to the float32 stream in float32, a sublayer's norm reads the stream rounded to the model dtype,
and the final norm (`final_normed`) normalises the float32 stream itself, its weighted product rounded to
the model dtype once. The blocks run in the model dtype either way; in a float32 model both ways are one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from worker_proc.kernels.interface import KernelOps, ResidualNorm


class Residual:
    """Rule: the stream is `h` plus `pending` times `multiplier` when an output is pending; that output is
    added exactly once, by the next `normed`, `final_normed` or `value` (or by `add`, before it holds the
    next one). `dtype` is the model dtype: what every norm returns; `h` is float32 instead when `fp32`."""

    __slots__ = ("dtype", "fp32", "h", "multiplier", "pending")

    def __init__(self, h: Tensor, fp32: bool = False) -> None:
        self.dtype = h.dtype
        self.fp32 = fp32 and h.dtype != torch.float32
        self.h = h.float() if self.fp32 else h
        self.pending: Tensor | None = None
        self.multiplier = 1.0

    def add(self, y: Tensor, multiplier: float, ops: KernelOps) -> None:
        """Hold `y` (times `multiplier`) to be added to the stream."""
        if self.pending is not None:
            self.value(ops)
        self.pending, self.multiplier = y, multiplier

    def normed(self, norm: ResidualNorm, ops: KernelOps, rows: Tensor | None = None) -> Tensor:
        """`norm` of the stream (of its `rows` only, leaving the stream as it is, when given); a float32
        stream is rounded to the model dtype first."""
        if self.fp32:
            return ops.rms_norm(norm, self._summed(rows).to(self.dtype))
        y = self.pending
        if rows is not None:
            h = self.h[rows]
            return ops.rms_norm(norm, h) if y is None else ops.add_rms_norm(norm, h, y[rows], self.multiplier)[1]
        if y is None:
            return ops.rms_norm(norm, self.h)
        self.h, x = ops.add_rms_norm(norm, self.h, y, self.multiplier)
        self.pending = None
        return x

    def final_normed(self, norm: ResidualNorm, ops: KernelOps, rows: Tensor | None = None) -> Tensor:
        """The model's final `norm` of the stream (of its `rows` only, leaving the stream as it is, when
        given), in the model dtype: a float32 stream is normalised as it is and the product rounded once."""
        if self.fp32:
            return norm(self._summed(rows)).to(self.dtype)
        return self.normed(norm, ops, rows)

    def value(self, ops: KernelOps) -> Tensor:
        """The stream with any pending output added (float32 when the stream is)."""
        return self._summed(None)

    def _summed(self, rows: Tensor | None) -> Tensor:
        """The stream plus any pending output (in the stream's dtype): the whole stream, which then keeps
        the sum, or its `rows`, leaving the stream as it is."""
        h, y = (self.h if rows is None else self.h[rows]), self.pending
        if y is not None:
            y = y if rows is None else y[rows]
            h = h + y if self.multiplier == 1.0 else h.add(y, alpha=self.multiplier)
        if rows is None:
            self.h, self.pending = h, None
        return h
