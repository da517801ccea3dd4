"""The Gated DeltaNet mixer of Qwen3-Next and Qwen3.5 (`linear_attn.*` of a layer).

Per token: projections q, k [k_heads, k_dim], v, z [v_heads, v_dim], b, a [v_heads], from either
layout (`gdn_fused_proj`): Qwen3-Next's in_proj_qkvz / in_proj_ba, whose rows are grouped per key
head ([q | k | v of its value heads | z of them] and [b | a] of its value heads), or Qwen3.5's
in_proj_qkv ([q | k | v]), in_proj_z, in_proj_b, in_proj_a. Then: causal depthwise conv1d (no bias)
+ SiLU over the channels q | k | v, continuing from the layer's conv state; q and k L2-normalised
and repeated to one per value head (value head j reads key head j // (v_heads / k_heads));
beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias); the gated delta rule with scale
1/sqrt(k_dim) advances the [v_heads, k_dim, v_dim] state in float32 (worker_proc.kernels.gated_delta;
the pool stores it as `--mamba-ssm-dtype` says, worker_proc.kernels.state_codec);
the output of each value head goes through the gated RMSNorm weight * rms_norm(o) * silu(z)
(plain weight, not zero-centred) and out_proj. The conv and recurrent states live in the worker's
pools (`gdn_conv`, `gdn_state`), read and advanced in place by state slot.
Under tensor parallelism every size is this rank's (`GdnShard`, worker_proc.model.tp).
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
from worker_proc.model.tp import GdnShard, ShardSpec, TPInfo, gdn_spec, row_parallel


class HeadGatedRMSNorm(nn.Module):
    """weight * (o / rms(o)) * silu(z) per value head (the norm over v_dim, weight shared by heads);
    the normalised o is cast to the model dtype before the weight, as the checkpoints' reference does."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = empty_param(size, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, o: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """o: [T, H, Dv] float32, z: [T, H, Dv] -> [T, H, Dv] in `dtype`."""
        of = o.float()
        of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * of.to(dtype) * F.silu(z.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    reduced = True  # out_proj is all-reduced here
    state_kind = "gdn"  # its pools: StatePools.layer_state("gdn", i)

    def __init__(self, cfg: HybridConfig, dtype: torch.dtype, device: torch.device, tp: TPInfo) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        s = self.shard = GdnShard.of(cfg, tp.rank, tp.size)
        hidden = cfg.hidden_size
        if cfg.gdn.fused_proj:
            self.in_proj_qkvz = Linear(hidden, 2 * s.key_dim + 2 * s.value_dim, bias=False, dtype=dtype, device=device)
            self.in_proj_ba = Linear(hidden, 2 * s.v_heads, bias=False, dtype=dtype, device=device)
        else:
            self.in_proj_qkv = Linear(hidden, s.conv_dim, bias=False, dtype=dtype, device=device)
            self.in_proj_z = Linear(hidden, s.value_dim, bias=False, dtype=dtype, device=device)
            self.in_proj_b = Linear(hidden, s.v_heads, bias=False, dtype=dtype, device=device)
            self.in_proj_a = Linear(hidden, s.v_heads, bias=False, dtype=dtype, device=device)
        self.conv1d = nn.Module()
        self.conv1d.weight = empty_param(s.conv_dim, 1, cfg.gdn.d_conv, dtype=dtype, device=device)
        self.A_log = empty_param(s.v_heads, dtype=dtype, device=device)
        self.dt_bias = empty_param(s.v_heads, dtype=dtype, device=device)
        self.norm = HeadGatedRMSNorm(s.v_dim, cfg.rms_norm_eps, dtype, device)
        self.out_proj = Linear(s.value_dim, hidden, bias=False, dtype=dtype, device=device)

    def shard_spec(self, sub: str) -> ShardSpec | None:
        return None if self.tp.size == 1 else gdn_spec(self.cfg, self.shard, sub)

    def _project(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(qkv [T, conv_dim] in conv channel order q | k | v, z [T, Hv, Dv], b [T, Hv], a [T, Hv])."""
        s, t = self.shard, h.shape[0]
        if not self.cfg.gdn.fused_proj:
            z = self.in_proj_z(h).view(t, s.v_heads, s.v_dim)
            return self.in_proj_qkv(h), z, self.in_proj_b(h), self.in_proj_a(h)
        per_k = s.v_heads // s.k_heads
        grouped = self.in_proj_qkvz(h).view(t, s.k_heads, -1)
        q, k, v, z = grouped.split([s.k_dim, s.k_dim, per_k * s.v_dim, per_k * s.v_dim], dim=-1)
        b, a = self.in_proj_ba(h).view(t, s.k_heads, 2 * per_k).split([per_k, per_k], dim=-1)
        qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return qkv, z.reshape(t, s.v_heads, s.v_dim), b.reshape(t, -1), a.reshape(t, -1)

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output [T, conv_dim] -> q, k [T, Hv, Dk] (L2-normalised, float32), v [T, Hv, Dv]."""
        s, t = self.shard, qkv.shape[0]
        q, k, v = qkv.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        q = l2_normalize(q.reshape(t, s.k_heads, s.k_dim))
        k = l2_normalize(k.reshape(t, s.k_heads, s.k_dim))
        per_k = s.v_heads // s.k_heads
        if per_k > 1:
            q, k = q.repeat_interleave(per_k, dim=1), k.repeat_interleave(per_k, dim=1)
        return q, k, v.reshape(t, s.v_heads, s.v_dim)

    def forward(self, h: torch.Tensor, batch: StepBatch, conv_pool: torch.Tensor, state_pool: StatePool,
                ops: KernelOps) -> torch.Tensor:  # fmt: skip
        """h: [T, hidden]; conv_pool: [S, conv_dim, K-1] and state_pool: [S, Hv, Dk, Dv] of this layer."""
        s = self.shard
        qkv, z, b, a = self._project(h)
        # the float32 steps of the reference, but sigmoid and softplus taken in float64 and rounded:
        # their float32 SIMD and scalar tails differ in the last bit, which would make a token's
        # values depend on the batch's size
        beta = torch.sigmoid(b.double()).float()
        g = -torch.exp(self.A_log.float()) * F.softplus((a.float() + self.dt_bias.float()).double()).float()
        weight = self.conv1d.weight[:, 0, :]
        scale = s.k_dim**-0.5

        def decode(group: DecodeGroup, rows: torch.Tensor | None) -> torch.Tensor:
            return self.recur_decode((qkv, g, beta), rows, group.state_slots, conv_pool, state_pool, ops)

        def prefill(rows: torch.Tensor | None) -> torch.Tensor:
            spans = batch.prefill_spans
            q, k, v = self._heads(ops.conv_prefill_many(rows_of(qkv, rows), conv_pool, spans, weight, None))
            return ops.gdn_prefill_many(q, k, v, rows_of(g, rows), rows_of(beta, rows), scale, state_pool, spans)

        batch.keep_recurrent_inputs(self, (qkv, g, beta), conv_pool, state_pool)
        out = self.norm(batch.by_group(decode, prefill), z, h.dtype).reshape(h.shape[0], s.value_dim)
        return row_parallel(out, self.out_proj, self.tp)

    def recur_decode(self, inputs: tuple[torch.Tensor, ...], rows: torch.Tensor | None, slots: torch.Tensor,
                     conv_pool: torch.Tensor, state_pool: StatePool, ops: KernelOps) -> torch.Tensor:  # fmt: skip
        """The conv and the gated delta rule of one token per state slot: `rows` of `inputs` = (qkv
        before the conv, g, beta) advance `slots` by one; the rule's output. A forward's decode group,
        and the replay of a verify slice's accepted tokens (worker_proc.spec.verify)."""
        qkv, g, beta = inputs
        q, k, v = self._heads(ops.conv_decode(rows_of(qkv, rows), conv_pool, slots, self.conv1d.weight[:, 0, :], None))
        return ops.gdn_decode(q, k, v, rows_of(g, rows), rows_of(beta, rows), self.shard.k_dim**-0.5, state_pool,
                              slots)  # fmt: skip
