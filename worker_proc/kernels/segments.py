"""Prefill of several requests' segments in one kernel call: the default, one call per segment.

A step's prefill rows, concatenated in slice order, are described by `Spans` ((length, state slot)
of each segment) or, for attention, `AttnSpans` ((length, start_pos, kv_idx)). `PerSegment` gives
every `KernelOps` the `*_prefill_many` methods (conv, SSD scan, attention, gated delta rule, selective
scan) by calling
its single-segment method once per span, so results are exactly the single calls' (what the
batch-invariant kernels keep); an implementation overrides them where one call over every segment
is cheaper (`FastOps`' Mamba conv and scan on CPU, `TritonOps`' varlen kernels). Whether padding
segments to one batched call pays is one rule for every CPU kernel: `batchable`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from worker_proc.kernels.interface import AttnSpans, SelectiveScanParams, Spans, SsdParams
from worker_proc.kernels.state_codec import StatePool

PAD_SLACK = 1.5
"""Prefill segments run as one batched call padded to the longest when that costs at most this factor
in rows, else one call each (many short calls cost more in dispatch than the padded rows' work)."""


def batchable(lengths: list[int]) -> bool:
    """Several segments whose padding to the longest would not exceed `PAD_SLACK` of their rows."""
    return len(lengths) > 1 and max(lengths) * len(lengths) <= PAD_SLACK * sum(lengths)


def pack(t: Tensor, lengths: list[int]) -> Tensor:
    """Consecutive segments of t's rows -> [S, longest, ...], zero past each segment's end."""
    return torch.nn.utils.rnn.pad_sequence(list(t.split(lengths)), batch_first=True)


def unpack(t: Tensor, lengths: list[int]) -> Tensor:
    """[S, longest, ...] -> the segments' real rows, concatenated."""
    return torch.cat([t[i, :length] for i, length in enumerate(lengths)])


def _joined(outs: list[Tensor]) -> Tensor:
    return outs[0] if len(outs) == 1 else torch.cat(outs)


class PerSegment:
    """Each `*_prefill_many` as a loop of the class's own single-segment method."""

    def conv_prefill_many(self, x: Tensor, conv_pool: Tensor, spans: Spans, weight: Tensor,
                          bias: Tensor | None, silu: bool = True) -> Tensor:  # fmt: skip
        outs, start = [], 0
        for length, slot in spans:
            outs.append(self.conv_prefill(x[start : start + length], conv_pool, slot, weight, bias, silu))
            start += length
        return _joined(outs)

    def ssd_prefill_many(self, x: Tensor, dt: Tensor, b: Tensor, c: Tensor, p: SsdParams, ssm_pool: StatePool,
                         spans: Spans) -> Tensor:  # fmt: skip
        outs, start = [], 0
        for length, slot in spans:
            rows = slice(start, start + length)
            outs.append(self.ssd_prefill(x[rows], dt[rows], b[rows], c[rows], p, ssm_pool, slot))
            start += length
        return _joined(outs)

    def attn_prefill_many(self, q: Tensor, k_pool: Tensor, v_pool: Tensor, spans: AttnSpans,
                          scale: float) -> Tensor:  # fmt: skip
        outs, start = [], 0
        for length, start_pos, kv_idx in spans:
            outs.append(self.attn_prefill(q[start : start + length], k_pool, v_pool, kv_idx, start_pos, scale))
            start += length
        return _joined(outs)

    def gdn_prefill_many(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                         state_pool: StatePool, spans: Spans) -> Tensor:  # fmt: skip
        outs, start = [], 0
        for length, slot in spans:
            rows = slice(start, start + length)
            outs.append(self.gdn_prefill(q[rows], k[rows], v[rows], g[rows], beta[rows], scale, state_pool, slot))
            start += length
        return _joined(outs)

    def selective_scan_prefill_many(self, x: Tensor, dt: Tensor, b: Tensor, c: Tensor, p: SelectiveScanParams,
                                    state_pool: StatePool, spans: Spans) -> Tensor:  # fmt: skip
        outs, start = [], 0
        for length, slot in spans:
            rows = slice(start, start + length)
            outs.append(self.selective_scan_prefill(x[rows], dt[rows], b[rows], c[rows], p, state_pool, slot))
            start += length
        return _joined(outs)
