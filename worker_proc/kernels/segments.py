"""Prefill of several requests' segments in one kernel call: the default, one call per segment.

A step's prefill rows, concatenated in slice order, are described by `Spans`: (length, state slot) of
each segment, consecutive. `PerSegment` gives every `KernelOps` the two `*_prefill_many` methods by
calling its single-segment method once per span, so results are exactly the single calls'; an
implementation overrides them where one batched call is cheaper (`FastOps` on CPU).
"""

from __future__ import annotations

import torch
from torch import Tensor

from worker_proc.kernels.interface import SsdParams
from worker_proc.kernels.state_codec import StatePool

Spans = tuple[tuple[int, int], ...]
"""(length, state slot) of each prefill segment, in row order; lengths >= 1, slots distinct."""


class PerSegment:
    """`conv_prefill_many` / `ssd_prefill_many` as a loop of the class's own `conv_prefill` / `ssd_prefill`."""

    def conv_prefill_many(self, x: Tensor, conv_pool: Tensor, spans: Spans, weight: Tensor,
                          bias: Tensor | None) -> Tensor:  # fmt: skip
        outs, start = [], 0
        for length, slot in spans:
            outs.append(self.conv_prefill(x[start : start + length], conv_pool, slot, weight, bias))
            start += length
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def ssd_prefill_many(self, x: Tensor, dt: Tensor, b: Tensor, c: Tensor, p: SsdParams, ssm_pool: StatePool,
                         spans: Spans) -> Tensor:  # fmt: skip
        outs, start = [], 0
        for length, slot in spans:
            rows = slice(start, start + length)
            outs.append(self.ssd_prefill(x[rows], dt[rows], b[rows], c[rows], p, ssm_pool, slot))
            start += length
        return outs[0] if len(outs) == 1 else torch.cat(outs)
