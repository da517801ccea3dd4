"""`Residual`: the residual stream of one forward between sublayers. A sublayer's output is held back
until the next norm reads the stream, which adds it in the same pass (`KernelOps.add_rms_norm`): one
read of the stream per sublayer instead of an add and then a norm."""

from __future__ import annotations

from torch import Tensor

from worker_proc.kernels.interface import KernelOps, ResidualNorm


class Residual:
    """Rule: the stream is `h` plus `pending` times `multiplier` when an output is pending; that output is
    added exactly once, by the next `normed` or `value` (or by `add`, before it holds the next one)."""

    __slots__ = ("h", "multiplier", "pending")

    def __init__(self, h: Tensor) -> None:
        self.h = h
        self.pending: Tensor | None = None
        self.multiplier = 1.0

    def add(self, y: Tensor, multiplier: float, ops: KernelOps) -> None:
        """Hold `y` (times `multiplier`) to be added to the stream."""
        if self.pending is not None:
            self.value(ops)
        self.pending, self.multiplier = y, multiplier

    def normed(self, norm: ResidualNorm, ops: KernelOps, rows: Tensor | None = None) -> Tensor:
        """`norm` of the stream (of its `rows` only, leaving the stream as it is, when given)."""
        y = self.pending
        if rows is not None:
            h = self.h[rows]
            return ops.rms_norm(norm, h) if y is None else ops.add_rms_norm(norm, h, y[rows], self.multiplier)[1]
        if y is None:
            return ops.rms_norm(norm, self.h)
        self.h, x = ops.add_rms_norm(norm, self.h, y, self.multiplier)
        self.pending = None
        return x

    def value(self, ops: KernelOps) -> Tensor:
        """The stream with any pending output added."""
        y = self.pending
        if y is not None:
            self.h = self.h + y if self.multiplier == 1.0 else self.h.add(y, alpha=self.multiplier)
            self.pending = None
        return self.h
