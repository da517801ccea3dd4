"""The gated short-convolution mixer of LFM2 (`conv.*` of a layer).

Per token: in_proj (hidden -> 3 * hidden, bias with `conv_bias`) splits into B | C | x; the causal
depthwise conv of width `d_conv` (bias with `conv_bias`, no activation) runs over B * x continuing
from the layer's conv window; y = C * conv; out_proj. The conv window is the layer's whole state:
it lives in the worker's pools (`short_conv_window`, worker_proc.state.pools), read and advanced in
place by state slot with the same conv kernels as the Mamba and Gated DeltaNet convs (`silu=False`);
this module owns no state of its own.
Tensor parallelism: every rank holds a contiguous 1/N of the hidden channels (`short_conv_spec`):
those rows of each of B, C and x in in_proj, those conv channels, those input columns of out_proj
(row-parallel, all-reduced here).
"""

from __future__ import annotations

import torch
from torch import nn

from shared.model_config import HybridConfig
from worker_proc.kernels import KernelOps
from worker_proc.model.batch import DecodeGroup, StepBatch, rows_of
from worker_proc.model.layers import Linear, empty_param
from worker_proc.model.shard import ShardSpec, TPInfo
from worker_proc.model.tp import row_parallel


def short_conv_spec(cfg: HybridConfig, tp: TPInfo, sub: str) -> ShardSpec | None:
    """This rank's slice of a short-conv tensor: its hidden channels of each segment."""
    hidden = cfg.hidden_size
    width = hidden // tp.size
    ch = (tp.rank * width, (tp.rank + 1) * width)
    proj = (ch, (ch[0] + hidden, ch[1] + hidden), (ch[0] + 2 * hidden, ch[1] + 2 * hidden))
    table = {"in_proj.weight": (0, proj), "in_proj.bias": (0, proj), "conv.weight": (0, (ch,)),
             "conv.bias": (0, (ch,)), "out_proj.weight": (1, (ch,))}
    hit = table.get(sub)
    return None if hit is None else ShardSpec(*hit)


class ShortConv(nn.Module):
    reduced = True  # out_proj is all-reduced here
    state_kind = "short_conv"  # its pools: StatePools.layer_state("short_conv", i)

    def __init__(self, cfg: HybridConfig, dtype: torch.dtype, device: torch.device, tp: TPInfo) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.width = width = cfg.hidden_size // tp.size
        bias = cfg.short_conv.bias
        self.in_proj = Linear(cfg.hidden_size, 3 * width, bias=bias, dtype=dtype, device=device)
        self.conv = nn.Module()
        self.conv.weight = empty_param(width, 1, cfg.short_conv.d_conv, dtype=dtype, device=device)
        self.conv.bias = empty_param(width, dtype=dtype, device=device) if bias else None
        self.out_proj = Linear(width, cfg.hidden_size, bias=bias, dtype=dtype, device=device)

    def shard_spec(self, sub: str) -> ShardSpec | None:
        return None if self.tp.size == 1 else short_conv_spec(self.cfg, self.tp, sub)

    def forward(self, h: torch.Tensor, batch: StepBatch, conv_pool: torch.Tensor, state_pool: None,
                ops: KernelOps) -> torch.Tensor:  # fmt: skip
        """h: [T, hidden]; conv_pool: [S, hidden / N, d_conv - 1] of this layer; `state_pool`: None (the
        conv window is the whole state)."""
        bcx = self.in_proj(h)
        weight = self.conv.weight[:, 0, :]

        def decode(group: DecodeGroup, rows: torch.Tensor | None) -> torch.Tensor:
            return ops.short_conv_decode(rows_of(bcx, rows), conv_pool, group.state_slots, weight, self.conv.bias)

        def prefill(rows: torch.Tensor | None) -> torch.Tensor:
            b, c, x = rows_of(bcx, rows).split(self.width, dim=-1)
            return c * ops.conv_prefill_many(b * x, conv_pool, batch.prefill_spans, weight, self.conv.bias, silu=False)

        if batch.kept_inputs is not None:  # a step that verifies drafts keeps B * x of every row
            b, _, x = bcx.split(self.width, dim=-1)
            batch.keep_recurrent_inputs(self, (b * x,), conv_pool, state_pool)
        return row_parallel(batch.by_group(decode, prefill), self.out_proj, self.tp)

    def recur_decode(self, inputs: tuple[torch.Tensor, ...], rows: torch.Tensor | None, slots: torch.Tensor,
                     conv_pool: torch.Tensor, state_pool: None, ops: KernelOps) -> torch.Tensor:  # fmt: skip
        """The conv of one token per state slot: `rows` of `inputs` = (B * x,) advance `slots` by one; the
        conv output. A forward's decode group, and the replay of a verify slice's accepted tokens
        (worker_proc.spec.verify)."""
        (bx,) = inputs
        return ops.conv_decode(rows_of(bx, rows), conv_pool, slots, self.conv.weight[:, 0, :], self.conv.bias,
                               silu=False)  # fmt: skip
