"""The grouped-query attention shared by every family (`self_attn.*` or `mixer.*` of a layer),
NoPE or RoPE (rotating the first `rotary_dim` channels of each head, the rest passed through).

Softmax scale = `attention_multiplier` (the family's parser sets it:
Granite's muP scale, else 1/sqrt(head_dim)); K is scaled by `key_multiplier` (Falcon-H1). K/V of this
step's tokens are written into the worker's KV pool at their slots *before* attention reads it, so
a request attends over its cached prefix and its own new tokens through the same slot list.
Gated attention (Qwen3-Next / Qwen3.5, `attn_output_gate`): q_proj yields [query | gate] per head and
the attention output is multiplied by sigmoid(gate) before o_proj; with `attn_qk_norm` q and k are
RMS-normed per head (`q_norm`, `k_norm`, zero-centred with `norm_unit_offset`) before RoPE.
"""

from __future__ import annotations

import torch
from torch import nn

from shared.model_config import HybridConfig
from worker_proc.kernels import KernelOps
from worker_proc.model.batch import StepBatch, rows_of
from worker_proc.model.layers import Linear, make_norm
from worker_proc.model.tp import AttnShard, ShardSpec, TPInfo, attn_spec, row_parallel


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype, axes: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Default RoPE tables for `positions` [T] -> (cos, sin) [T, 1, head_dim] in `dtype`.

    The angles are the float32 products transformers uses; cos/sin are taken in float64 and rounded,
    so a position's table entry does not depend on which other positions share the call (SIMD vs
    scalar tails of float32 cos/sin differ in the last bit, which would break batch invariance).
    Multimodal RoPE (`axes`: int64 [head_dim / 2], the position axis of each frequency,
    AttentionConfig.rope_axes, made once by the caller): `positions` is [3, T] (t, h, w) and frequency
    i's angle is the product with row axes[i]; a row whose three positions are equal gets exactly the one-axis table."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim)
    )
    if axes is not None:
        if positions.dim() != 2 or positions.shape[0] != 3 or axes.shape != inv_freq.shape:
            raise ValueError(f"multimodal RoPE takes [3, T] positions and one axis per frequency, got "
                             f"{tuple(positions.shape)} and {tuple(axes.shape)} axes")
        every = positions.float()[:, :, None] * inv_freq  # [3, T, head_dim / 2]: each axis' angles
        freqs = every.gather(0, axes.expand(1, positions.shape[1], -1))[0].double()
    else:
        freqs = (positions.float()[:, None] * inv_freq[None, :]).double()
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, d]; cos, sin: [T, 1, r] with r <= d: the first r channels rotate."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot = x[..., :r]
    return torch.cat([rot * cos + _rotate_half(rot) * sin, x[..., r:]], dim=-1)


class Attention(nn.Module):
    """This rank's query/KV heads (see worker_proc.model.tp): column-parallel q/k/v, row-parallel o_proj."""

    reduced = True  # o_proj is all-reduced here

    def __init__(self, cfg: HybridConfig, dtype: torch.dtype, device: torch.device, tp: TPInfo) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        shard = self.shard = AttnShard.of(cfg, tp.rank, tp.size)
        self.heads, self.kv_heads = shard.heads, shard.kv_heads
        hd, bias = cfg.attn.head_dim, cfg.attn.bias
        q_out = self.heads * hd * (2 if cfg.attn.output_gate else 1)
        self.q_proj = Linear(cfg.hidden_size, q_out, bias=bias, dtype=dtype, device=device)
        self.k_proj = Linear(cfg.hidden_size, self.kv_heads * hd, bias=bias, dtype=dtype, device=device)
        self.v_proj = Linear(cfg.hidden_size, self.kv_heads * hd, bias=bias, dtype=dtype, device=device)
        self.o_proj = Linear(self.heads * hd, cfg.hidden_size, bias=bias, dtype=dtype, device=device)
        self.q_norm = self.k_norm = None
        if cfg.attn.qk_norm:
            self.q_norm = make_norm(hd, cfg.rms_norm_eps, dtype, device, cfg.norm_unit_offset)
            self.k_norm = make_norm(hd, cfg.rms_norm_eps, dtype, device, cfg.norm_unit_offset)

    def shard_spec(self, sub: str) -> ShardSpec | None:
        return None if self.tp.size == 1 else attn_spec(self.cfg, self.shard, sub)

    def forward(
        self,
        h: torch.Tensor,
        batch: StepBatch,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        ops: KernelOps,
    ) -> torch.Tensor:
        """h: [T, hidden]; k_pool, v_pool: [S, kvh, d] of this layer; rope: (cos, sin) or None."""
        cfg = self.cfg
        t = h.shape[0]
        gate = None
        if cfg.attn.output_gate:
            q, gate = self.q_proj(h).view(t, self.heads, 2 * cfg.attn.head_dim).chunk(2, dim=-1)
        else:
            q = self.q_proj(h).view(t, self.heads, cfg.attn.head_dim)
        k = self.k_proj(h).view(t, self.kv_heads, cfg.attn.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # per head: each head's row of q and of k
            hd = cfg.attn.head_dim
            q = ops.rms_norm(self.q_norm, q.reshape(-1, hd)).view(t, self.heads, hd)
            k = ops.rms_norm(self.k_norm, k.reshape(-1, hd)).view(t, self.kv_heads, hd)
        if cfg.attn.key_multiplier != 1.0:
            k = k * cfg.attn.key_multiplier
        v = self.v_proj(h).view(t, self.kv_heads, cfg.attn.head_dim)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        k_pool.index_copy_(0, batch.new_kv_slots, k.to(k_pool.dtype))
        v_pool.index_copy_(0, batch.new_kv_slots, v.to(v_pool.dtype))
        scale = cfg.attn.scale
        out = batch.by_group(
            lambda group, rows: ops.attn_decode(rows_of(q, rows).contiguous(), k_pool, v_pool, group.kv_idx,
                                                group.kv_len, scale),  # fmt: skip
            lambda rows: ops.attn_prefill_many(rows_of(q, rows), k_pool, v_pool, batch.prefill_attn_spans, scale),
        )
        out = out.reshape(t, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate.reshape(t, -1))
        return row_parallel(out, self.o_proj, self.tp)
