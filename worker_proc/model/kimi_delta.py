"""The Kimi Delta Attention mixer of Kimi Linear (`self_attn.*` of its linear-attention layers).

Per token, for `heads` heads of `head_dim` channels (KdaConfig): q, k, v from q_proj / k_proj / v_proj,
each through its own causal depthwise conv (`q_conv1d`, `k_conv1d`, `v_conv1d`, no bias) + SiLU,
continuing from the layer's conv windows (one pool tensor over the channels q | k | v); q and k
L2-normalised; the per-channel log decay g = -exp(A_log[h]) * softplus(f_b_proj(f_a_proj(x)) +
dt_bias) [heads, head_dim]; beta = sigmoid(b_proj(x)) per head; the per-channel gated delta rule with
scale 1/sqrt(head_dim) advances the [heads, head_dim, head_dim] state in float32
(worker_proc.kernels.kimi_delta; the backend is the kernel set's, the pool's storage dtype is
`--mamba-ssm-dtype`'s, worker_proc.kernels.state_codec); the output, rounded to the model dtype, goes
through the sigmoid-gated RMSNorm `o_norm` (float32 weight * rms_norm(o) * sigmoid(g_b_proj(g_a_proj(x))))
and o_proj. The conv windows and the recurrent state live in the worker's pools (`kda_conv`,
`kda_state`), read and advanced in place by state slot; this module owns no state.
Tensor parallelism: every rank holds a contiguous 1/N of the heads (`kda_spec`): those rows of the
q/k/v projections and convs, of f_b_proj, g_b_proj, b_proj, dt_bias and A_log, those input columns of
o_proj (row-parallel, all-reduced here); f_a_proj, g_a_proj (the low-rank inputs) and o_norm are
replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shared.model_config import HybridConfig
from worker_proc.kernels import KernelOps
from worker_proc.kernels.gated_delta import l2_normalize
from worker_proc.kernels.state_codec import StatePool
from worker_proc.model.batch import DecodeGroup, StepBatch, rows_of
from worker_proc.model.layers import Linear, empty_param
from worker_proc.model.shard import ShardSpec, TPInfo
from worker_proc.model.tp import row_parallel

_CHANNEL_ROWS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight",
                 "v_conv1d.weight", "f_b_proj.weight", "g_b_proj.weight", "dt_bias")


def kda_spec(cfg: HybridConfig, tp: TPInfo, sub: str) -> ShardSpec | None:
    """This rank's slice of a KDA tensor: its heads' channels, its heads, or o_proj's input columns."""
    heads, d = cfg.kda.heads // tp.size, cfg.kda.head_dim
    ch = ((tp.rank * heads * d, (tp.rank + 1) * heads * d),)
    own = ((tp.rank * heads, (tp.rank + 1) * heads),)
    if sub in _CHANNEL_ROWS:
        return ShardSpec(0, ch)
    if sub == "b_proj.weight":
        return ShardSpec(0, own)
    if sub == "A_log":
        return ShardSpec(2, own)
    if sub == "o_proj.weight":
        return ShardSpec(1, ch)
    return None


class KimiDeltaAttention(nn.Module):
    reduced = True  # o_proj is all-reduced here
    state_kind = "kda"  # its pools: StatePools.layer_state("kda", i)

    def __init__(self, cfg: HybridConfig, dtype: torch.dtype, device: torch.device, tp: TPInfo) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.heads, self.head_dim = cfg.kda.heads // tp.size, cfg.kda.head_dim
        hidden, width, d = cfg.hidden_size, self.heads * cfg.kda.head_dim, cfg.kda.head_dim
        self.width = width
        for name in ("q", "k", "v"):
            setattr(self, f"{name}_proj", Linear(hidden, width, bias=False, dtype=dtype, device=device))
            conv = nn.Module()
            conv.weight = empty_param(width, 1, cfg.kda.d_conv, dtype=dtype, device=device)
            setattr(self, f"{name}_conv1d", conv)
        self.A_log = empty_param(1, 1, self.heads, 1, dtype=dtype, device=device)
        self.dt_bias = empty_param(width, dtype=torch.float32, device=device)
        self.f_a_proj = Linear(hidden, d, bias=False, dtype=dtype, device=device)
        self.f_b_proj = Linear(d, width, bias=False, dtype=dtype, device=device)
        self.b_proj = Linear(hidden, self.heads, bias=False, dtype=dtype, device=device)
        self.g_a_proj = Linear(hidden, d, bias=False, dtype=dtype, device=device)
        self.g_b_proj = Linear(d, width, bias=False, dtype=dtype, device=device)
        self.o_norm = nn.Module()
        self.o_norm.weight = empty_param(d, dtype=dtype, device=device)
        self.o_proj = Linear(width, hidden, bias=False, dtype=dtype, device=device)

    def shard_spec(self, sub: str) -> ShardSpec | None:
        return None if self.tp.size == 1 else kda_spec(self.cfg, self.tp, sub)

    def _conv_weight(self) -> torch.Tensor:
        """[3 * width, d_conv]: the q | k | v convs' taps, in the conv pool's channel order."""
        return torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])[:, 0, :]

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output [T, 3 * width] -> q, k [T, H, D] (L2-normalised, float32), v [T, H, D]."""
        t = qkv.shape[0]
        q, k, v = (x.reshape(t, self.heads, self.head_dim) for x in qkv.split(self.width, dim=-1))
        return l2_normalize(q), l2_normalize(k), v

    def _gates(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(g [T, H, D] per-channel log decay, beta [T, H]), float32. Softplus and sigmoid are taken in
        float64 and rounded: their float32 SIMD and scalar tails differ in the last bit, which would
        make a token's values depend on the batch's size."""
        t = h.shape[0]
        pre = (self.f_b_proj(self.f_a_proj(h)).float() + self.dt_bias.float()).view(t, self.heads, self.head_dim)
        decay = torch.exp(self.A_log.float().view(self.heads, 1))
        g = -decay * F.softplus(pre.double()).float()
        beta = torch.sigmoid(self.b_proj(h).double()).float()
        return g, beta

    def _out_norm(self, o: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """weight * rms_norm(o) * sigmoid(gate) per head in float32 -> [T, width] in h's dtype."""
        t = h.shape[0]
        gate = self.g_b_proj(self.g_a_proj(h)).view(t, self.heads, self.head_dim).float()
        of = o.to(h.dtype).float()
        of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        out = self.o_norm.weight.float() * of * torch.sigmoid(gate.double()).float()
        return out.to(h.dtype).reshape(t, self.width)

    def forward(self, h: torch.Tensor, batch: StepBatch, conv_pool: torch.Tensor, state_pool: StatePool,
                ops: KernelOps) -> torch.Tensor:  # fmt: skip
        """h: [T, hidden]; conv_pool: [S, 3 * width, d_conv - 1] and state_pool: [S, H, D, D] of this layer."""
        qkv = torch.cat([self.q_proj(h), self.k_proj(h), self.v_proj(h)], dim=-1)
        g, beta = self._gates(h)
        scale = self.head_dim**-0.5

        def decode(group: DecodeGroup, rows: torch.Tensor | None) -> torch.Tensor:
            return self.recur_decode((qkv, g, beta), rows, group.state_slots, conv_pool, state_pool, ops)

        def prefill(rows: torch.Tensor | None) -> torch.Tensor:
            spans = batch.prefill_spans
            q, k, v = self._heads(ops.conv_prefill_many(rows_of(qkv, rows), conv_pool, spans, self._conv_weight(),
                                                        None))  # fmt: skip
            return ops.kda_prefill_many(q, k, v, rows_of(g, rows), rows_of(beta, rows), scale, state_pool, spans)

        batch.keep_recurrent_inputs(self, (qkv, g, beta), conv_pool, state_pool)
        return row_parallel(self._out_norm(batch.by_group(decode, prefill), h), self.o_proj, self.tp)

    def recur_decode(self, inputs: tuple[torch.Tensor, ...], rows: torch.Tensor | None, slots: torch.Tensor,
                     conv_pool: torch.Tensor, state_pool: StatePool, ops: KernelOps) -> torch.Tensor:  # fmt: skip
        """The convs and the rule of one token per state slot: `rows` of `inputs` = (q | k | v before the
        conv, g, beta) advance `slots` by one; the rule's output. A forward's decode group, and the replay
        of a verify slice's accepted tokens (worker_proc.spec.verify)."""
        qkv, g, beta = inputs
        q, k, v = self._heads(ops.conv_decode(rows_of(qkv, rows), conv_pool, slots, self._conv_weight(), None))
        return ops.kda_decode(q, k, v, rows_of(g, rows), rows_of(beta, rows), self.head_dim**-0.5, state_pool,
                              slots)  # fmt: skip
