"""Multi-head Latent Attention as Kimi Linear runs it (`self_attn.*` of its full-attention layers).

Per token (MlaConfig): q [heads, qk_dim] from q_proj, or from q_b_proj(RMSNorm(q_a_proj(x))) with a q
LoRA rank; kv_a_proj_with_mqa(x) = [latent (kv_lora_rank) | shared key (rope_dim)]; the latent is
RMS-normed (`kv_a_layernorm`) and kv_b_proj expands it into each head's [key nope_dim | value v_dim];
each head's key is [its nope part | the shared part]. Kimi Linear's MLA is NoPE: no channel rotates.
Softmax scale 1/sqrt(qk_dim).
The KV pool holds the decompressed per-head K and V (the shared GQA pool with kv_heads = heads, its
head_dim the wider of qk_dim and v_dim, the narrower one zero-padded: zeros add nothing to q·k and
the padded value channels are dropped after attention); caching the compressed latent instead is a
separate pool layout, not this one. K/V of the step's tokens are written before attention reads them,
as `Attention` does.
Tensor parallelism: every rank holds a contiguous 1/N of the heads (`mla_spec`): those rows of q_proj
/ q_b_proj and kv_b_proj, those input columns of o_proj (row-parallel, all-reduced here), and so its
heads' K and V in its KV pool; kv_a_proj_with_mqa, q_a_proj and both norms are replicated (every rank
computes the latent).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shared.model_config import HybridConfig
from worker_proc.kernels import KernelOps
from worker_proc.model.batch import StepBatch, rows_of
from worker_proc.model.layers import Linear, make_norm
from worker_proc.model.shard import ShardSpec, TPInfo
from worker_proc.model.tp import row_parallel

LATENT_NORM_EPS = 1e-6
"""The eps of `kv_a_layernorm` and `q_a_layernorm` (transformers builds them with its RMSNorm's default)."""


def mla_spec(cfg: HybridConfig, tp: TPInfo, sub: str) -> ShardSpec | None:
    """This rank's slice of an MLA tensor: its heads' rows of the per-head projections, its heads'
    input columns of o_proj."""
    m, heads = cfg.mla, cfg.attn.num_heads // tp.size
    first, last = tp.rank * heads, (tp.rank + 1) * heads
    rows = {"q_proj.weight": m.qk_dim, "q_b_proj.weight": m.qk_dim, "kv_b_proj.weight": m.nope_dim + m.v_dim}
    if sub in rows:
        return ShardSpec(0, ((first * rows[sub], last * rows[sub]),))
    if sub == "o_proj.weight":
        return ShardSpec(1, ((first * m.v_dim, last * m.v_dim),))
    return None


class LatentAttention(nn.Module):
    reduced = True  # o_proj is all-reduced here
    attends = True  # reads and writes its layer's KV pool

    def __init__(self, cfg: HybridConfig, dtype: torch.dtype, device: torch.device, tp: TPInfo) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        m, hidden, bias = cfg.mla, cfg.hidden_size, cfg.attn.bias
        self.heads = cfg.attn.num_heads // tp.size
        if m.q_lora_rank:
            self.q_a_proj = Linear(hidden, m.q_lora_rank, bias=bias, dtype=dtype, device=device)
            self.q_a_layernorm = make_norm(m.q_lora_rank, LATENT_NORM_EPS, dtype, device)
            self.q_b_proj = Linear(m.q_lora_rank, self.heads * m.qk_dim, bias=False, dtype=dtype, device=device)
        else:
            self.q_proj = Linear(hidden, self.heads * m.qk_dim, bias=False, dtype=dtype, device=device)
        self.kv_a_proj_with_mqa = Linear(hidden, m.kv_lora_rank + m.rope_dim, bias=bias, dtype=dtype, device=device)
        self.kv_a_layernorm = make_norm(m.kv_lora_rank, LATENT_NORM_EPS, dtype, device)
        self.kv_b_proj = Linear(m.kv_lora_rank, self.heads * (m.nope_dim + m.v_dim), bias=False, dtype=dtype,
                                device=device)  # fmt: skip
        self.o_proj = Linear(self.heads * m.v_dim, hidden, bias=bias, dtype=dtype, device=device)

    def shard_spec(self, sub: str) -> ShardSpec | None:
        return None if self.tp.size == 1 else mla_spec(self.cfg, self.tp, sub)

    def _qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k [T, heads, qk_dim], v [T, heads, v_dim] of the step's tokens."""
        m, t = self.cfg.mla, h.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(h))) if m.q_lora_rank else self.q_proj(h)
        latent, shared = self.kv_a_proj_with_mqa(h).split([m.kv_lora_rank, m.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(t, self.heads, m.nope_dim + m.v_dim)
        k_nope, v = kv.split([m.nope_dim, m.v_dim], dim=-1)
        k = torch.cat([k_nope, shared[:, None, :].expand(t, self.heads, m.rope_dim)], dim=-1)
        return q.view(t, self.heads, m.qk_dim), k, v

    def forward(self, h: torch.Tensor, batch: StepBatch, rope: tuple[torch.Tensor, torch.Tensor] | None,
                k_pool: torch.Tensor, v_pool: torch.Tensor, ops: KernelOps) -> torch.Tensor:  # fmt: skip
        """h: [T, hidden]; k_pool, v_pool: [S, heads, cfg.attn.head_dim] of this layer; `rope` unused (NoPE)."""
        m, t, d = self.cfg.mla, h.shape[0], self.cfg.attn.head_dim
        q, k, v = self._qkv(h)
        q, k, v = (F.pad(x, (0, d - x.shape[-1])) if x.shape[-1] < d else x for x in (q, k, v))
        k_pool.index_copy_(0, batch.new_kv_slots, k.to(k_pool.dtype))
        v_pool.index_copy_(0, batch.new_kv_slots, v.to(v_pool.dtype))
        scale = self.cfg.attn.scale
        out = batch.by_group(
            lambda group, rows: ops.attn_decode(rows_of(q, rows).contiguous(), k_pool, v_pool, group.kv_idx,
                                                group.kv_len, scale),  # fmt: skip
            lambda rows: ops.attn_prefill_many(rows_of(q, rows), k_pool, v_pool, batch.prefill_attn_spans, scale),
        )
        return row_parallel(out[..., : m.v_dim].reshape(t, -1), self.o_proj, self.tp)
