"""Multi-head Latent Attention as Kimi Linear runs it (`self_attn.*` of its full-attention layers).

Per token (MlaConfig): q [heads, qk_dim] from q_proj, or from q_b_proj(RMSNorm(q_a_proj(x))) with a q
LoRA rank; kv_a_proj_with_mqa(x) = [latent (kv_lora_rank) | shared key (rope_dim)]; the latent is
RMS-normed (`kv_a_layernorm`); kv_b_proj [heads * (nope_dim + v_dim), kv_lora_rank] would expand it into
each head's [key nope_dim | value v_dim], each head's key being [its nope part | the shared part].
Kimi Linear's MLA is NoPE: no channel rotates. Softmax scale 1/sqrt(qk_dim).
The KV pool caches the compressed latent, not the expanded heads: one KV head per token, K = [normed
latent | shared key] (head_dim kv_lora_rank + rope_dim), and nothing else: the V pool of an MLA model
has no channels (HybridConfig.kv_value_dim), so a token costs (kv_lora_rank + rope_dim) * itemsize per
layer. The kernels read the K pool as V as well; the attention output's first kv_lora_rank channels are
then the weighted latent, and its rope_dim trailing channels (the weighted shared key) are dropped.
kv_b_proj is absorbed instead: each head's query becomes [q_nope W_uk | q_rope] (W_uk: its key rows of
kv_b_proj), so q·K is the expanded q·k, and the attention output's latent part times W_uvᵀ (its value
rows) is the expanded output. The checkpoint's kv_b_proj.weight is only the loading target: `absorb`
(run once the weights are in, worker_proc.loading.checkpoint) moves it into two `Linear`s per head,
`absorb_k[h]` (weight W_uk[h]ᵀ [kv_lora_rank, nope_dim]) and `absorb_v[h]` (weight W_uv[h] [v_dim,
kv_lora_rank]), and empties it. They are planned products like any other, so --quantization quantizes
them, each row of its own weight: W_uv's rows are kv_b_proj's value rows, W_ukᵀ's rows are latent
channels (each a column of the head's key rows); either way an int8 / int4 / fp8 weight times the
exact activation, the same approximation as any quantized product. They take no adapter (nor does
kv_b_proj). The step's tokens' K rows are written before attention reads them, as `Attention` does.
Tensor parallelism: every rank holds a contiguous 1/N of the heads (`mla_spec`): those rows of q_proj /
q_b_proj and kv_b_proj, those input columns of o_proj (row-parallel, all-reduced here);
kv_a_proj_with_mqa, q_a_proj and both norms are replicated, and so is the cached latent (the one KV head
is replicated on every rank, AttnShard's rule for fewer KV heads than ranks).
"""

from __future__ import annotations

import torch
from torch import nn

from shared.model_config import HybridConfig
from worker_proc.kernels import KernelOps
from worker_proc.model.batch import StepBatch, rows_of
from worker_proc.model.layers import Linear, empty_param, make_norm
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


def _per_head(x: torch.Tensor, products: nn.ModuleList) -> torch.Tensor:
    """x [T, heads, a] through each head's product (a -> b) -> [T, heads, b]."""
    return torch.stack([product(x[:, i].contiguous()) for i, product in enumerate(products)], dim=1)


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
        self.kv_b_proj = nn.Module()  # the loading target of `absorb_k` and `absorb_v` (see `absorb`)
        self.kv_b_proj.weight = empty_param(self.heads * (m.nope_dim + m.v_dim), m.kv_lora_rank, dtype=dtype,
                                            device=device)  # fmt: skip
        self.absorb_k: nn.ModuleList | None = None
        self.absorb_v: nn.ModuleList | None = None
        self.o_proj = Linear(self.heads * m.v_dim, hidden, bias=bias, dtype=dtype, device=device)

    def shard_spec(self, sub: str) -> ShardSpec | None:
        return None if self.tp.size == 1 else mla_spec(self.cfg, self.tp, sub)

    @torch.no_grad()
    def absorb(self) -> None:
        """Move the loaded kv_b_proj.weight into each head's products: `absorb_k[h]` (nope_dim ->
        kv_lora_rank, weight W_uk[h]ᵀ) and `absorb_v[h]` (kv_lora_rank -> v_dim, weight W_uv[h]); kv_b_proj's
        weight is then empty. Once, before quantization and the execution plan see the model's products."""
        if self.absorb_k is not None:
            raise RuntimeError("kv_b_proj was absorbed already")
        m, w = self.cfg.mla, self.kv_b_proj.weight
        dtype, device = w.dtype, w.device
        heads = w.view(self.heads, m.nope_dim + m.v_dim, m.kv_lora_rank)
        self.absorb_k = nn.ModuleList(Linear(m.nope_dim, m.kv_lora_rank, bias=False, dtype=dtype, device=device)
                                      for _ in range(self.heads))  # fmt: skip
        self.absorb_v = nn.ModuleList(Linear(m.kv_lora_rank, m.v_dim, bias=False, dtype=dtype, device=device)
                                      for _ in range(self.heads))  # fmt: skip
        for head, k, v in zip(heads, self.absorb_k, self.absorb_v, strict=True):
            k.weight.copy_(head[: m.nope_dim].T)
            v.weight.copy_(head[m.nope_dim :])
        self.kv_b_proj.weight = nn.Parameter(w.new_empty(0), requires_grad=False)

    def _qk(self, h: torch.Tensor, absorb_k: nn.ModuleList) -> tuple[torch.Tensor, torch.Tensor]:
        """The absorbed query [T, heads, kv_lora_rank + rope_dim] and the step's cached rows [T, 1,
        kv_lora_rank + rope_dim] (K, read as V too)."""
        m, t = self.cfg.mla, h.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(h))) if m.q_lora_rank else self.q_proj(h)
        q_nope, q_rope = q.view(t, self.heads, m.qk_dim).split([m.nope_dim, m.rope_dim], dim=-1)
        q = torch.cat([_per_head(q_nope, absorb_k), q_rope], dim=-1)
        latent, shared = self.kv_a_proj_with_mqa(h).split([m.kv_lora_rank, m.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        return q, torch.cat([latent, shared], dim=-1)[:, None, :]

    def forward(self, h: torch.Tensor, batch: StepBatch, rope: tuple[torch.Tensor, torch.Tensor] | None,
                k_pool: torch.Tensor, v_pool: torch.Tensor, ops: KernelOps) -> torch.Tensor:  # fmt: skip
        """h: [T, hidden]; k_pool: [S, 1, kv_lora_rank + rope_dim] of this layer, read as K and V; v_pool:
        [S, 1, 0], never read; `rope` unused (NoPE)."""
        m, t = self.cfg.mla, h.shape[0]
        assert self.absorb_k is not None and self.absorb_v is not None, "kv_b_proj was never absorbed"
        q, k = self._qk(h, self.absorb_k)
        k_pool.index_copy_(0, batch.new_kv_slots, k.to(k_pool.dtype))
        scale = self.cfg.attn.scale
        out = batch.by_group(
            lambda group, rows: ops.attn_decode(rows_of(q, rows).contiguous(), k_pool, k_pool, group.kv_idx,
                                                group.kv_len, scale),  # fmt: skip
            lambda rows: ops.attn_prefill_many(rows_of(q, rows), k_pool, k_pool, batch.prefill_attn_spans, scale),
        )
        o = _per_head(out[..., : m.kv_lora_rank], self.absorb_v)
        return row_parallel(o.reshape(t, -1), self.o_proj, self.tp)
