"""Tensor-parallel layout of one rank: which heads, groups and channels it holds, which slice of
every checkpoint tensor it loads, and the collectives of the forward pass.

The rules (N = tp size, r = rank):
- Attention: query heads split evenly; KV heads split evenly when N divides them, else every
  rank holds the one KV head its query heads read (N must then be a multiple of the KV heads).
  q/k/v projections are column-parallel, o_proj row-parallel (all-reduce, bias added once after).
- Mamba: heads split evenly, with their x conv channels, dt, A_log, D, dt_bias, z and norm
  channels. B/C groups split evenly when N divides n_groups; otherwise every rank holds the
  (contiguous) groups its heads map to, with their conv channels. out_proj is row-parallel.
- Gated RMSNorm is grouped by n_groups: when N divides n_groups each rank holds whole norm
  groups and normalises locally; otherwise a norm group spans ranks and the per-group sums of
  squares are all-reduced before normalising (exact, every rank gets the same statistics).
- Gated DeltaNet: key heads split evenly, each rank with the value heads that read them (value
  head j reads key head j // (v_heads / k_heads)): their q/k/v conv channels, z, b, a, A_log and
  dt_bias; the per-head output norm is replicated, out_proj row-parallel.
- Gated attention (output gate): q_proj's rows are [query | gate] per head, split by whole heads.
- MLPs (fused or split gated, relu2) and MoE experts: split on the intermediate dimension (gate
  and up halves each); routers and Nemotron-H's latent projections are replicated. A sublayer's
  MLP + MoE partial sums are all-reduced once (worker_proc.model.hybrid).
- Each block names the slice of each of its tensors (`shard_spec`, built from the functions
  here); the model asks the block that owns a parameter.
- Embedding, LM head and the residual-stream norms are replicated: every rank holds the same
  hidden state after each all-reduce and computes the same logits; rank 0 samples.
With N = 1 nothing is sliced and no collective runs: the single-rank path is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shared.model_config import HybridConfig
from worker_proc.model.layers import Linear, empty_param
from worker_proc.model.shard import Range, ShardSpec, TPInfo, column_spec

__all__ = ["AttnShard", "GdnShard", "MambaShard", "Range", "ShardSpec", "SpanGatedRMSNorm", "TPInfo", "column_spec",
           "row_parallel"]

@dataclass(frozen=True)
class AttnShard:
    heads: int  # local query heads
    head_start: int
    kv_heads: int  # local KV heads
    kv_start: int

    @staticmethod
    def of(cfg: HybridConfig, rank: int, size: int) -> AttnShard:
        if not cfg.attn_layer_ids:
            return AttnShard(0, 0, 0, 0)  # no attention layer: nothing to hold
        heads = cfg.attn.num_heads // size
        if cfg.attn.num_kv_heads >= size:
            kv = cfg.attn.num_kv_heads // size
            return AttnShard(heads, rank * heads, kv, rank * kv)
        q_per_kv = cfg.attn.num_heads // cfg.attn.num_kv_heads
        return AttnShard(heads, rank * heads, 1, (rank * heads) // q_per_kv)


@dataclass(frozen=True)
class MambaShard:
    heads: int  # local Mamba heads [head_start, head_start + heads)
    head_start: int
    d_head: int
    d_state: int
    groups: tuple[int, ...]  # global B/C groups held, contiguous and ascending
    head_group: tuple[int, ...] | None  # local group index of each local head; None = evenly spread
    norm_groups: int  # local norm groups when norm_shared is False
    norm_shared: bool  # a norm group spans ranks: sums of squares are all-reduced
    norm_group_size: int  # channels per (global) norm group

    @staticmethod
    def of(cfg: HybridConfig, rank: int, size: int) -> MambaShard:
        heads, g_all = cfg.mamba.n_heads // size, cfg.mamba.n_groups
        start = rank * heads
        per_group = cfg.mamba.n_heads // g_all
        of_head = [(start + j) // per_group for j in range(heads)]
        groups = tuple(range(of_head[0], of_head[-1] + 1)) if heads else ()
        counts = [of_head.count(g) for g in groups]
        even = len(set(counts)) <= 1
        head_group = None if even else tuple(g - groups[0] for g in of_head)
        shared = g_all % size != 0
        return MambaShard(
            heads=heads, head_start=start, d_head=cfg.mamba.d_head, d_state=cfg.mamba.d_state,
            groups=groups, head_group=head_group, norm_groups=max(1, g_all // size), norm_shared=shared,
            norm_group_size=cfg.mamba.intermediate // g_all,
        )

    @property
    def inner(self) -> int:
        return self.heads * self.d_head

    @property
    def inner_start(self) -> int:
        return self.head_start * self.d_head

    @property
    def group_dim(self) -> int:
        return len(self.groups) * self.d_state

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.group_dim


@dataclass(frozen=True)
class GdnShard:
    k_heads: int  # local key heads [k_start, k_start + k_heads)
    k_start: int
    v_heads: int  # local value heads [v_start, v_start + v_heads)
    v_start: int
    k_dim: int
    v_dim: int

    @staticmethod
    def of(cfg: HybridConfig, rank: int, size: int) -> GdnShard:
        if not cfg.gdn_layer_ids:
            return GdnShard(0, 0, 0, 0, cfg.gdn.k_dim, cfg.gdn.v_dim)
        kh = cfg.gdn.k_heads // size
        vh = kh * (cfg.gdn.v_heads // cfg.gdn.k_heads)
        return GdnShard(kh, rank * kh, vh, rank * vh, cfg.gdn.k_dim, cfg.gdn.v_dim)

    @property
    def key_dim(self) -> int:
        return self.k_heads * self.k_dim

    @property
    def value_dim(self) -> int:
        return self.v_heads * self.v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


def gdn_spec(cfg: HybridConfig, s: GdnShard, sub: str) -> ShardSpec | None:
    """This rank's slice of a Gated DeltaNet tensor (both projection layouts)."""
    key_all = cfg.gdn.k_heads * cfg.gdn.k_dim
    q = (s.k_start * s.k_dim, s.k_start * s.k_dim + s.key_dim)
    v = (s.v_start * s.v_dim, s.v_start * s.v_dim + s.value_dim)
    heads = (s.v_start, s.v_start + s.v_heads)
    qkv = (q, (q[0] + key_all, q[1] + key_all), (v[0] + 2 * key_all, v[1] + 2 * key_all))
    per_k = s.v_heads // max(s.k_heads, 1)  # value heads per key head
    group = 2 * s.k_dim + 2 * per_k * s.v_dim  # in_proj_qkvz rows of one key head
    k_heads = (s.k_start, s.k_start + s.k_heads)
    table = {
        "conv1d.weight": (0, qkv), "in_proj_qkv.weight": (0, qkv), "in_proj_z.weight": (0, (v,)),
        "in_proj_b.weight": (0, (heads,)), "in_proj_a.weight": (0, (heads,)),
        "in_proj_qkvz.weight": (0, ((k_heads[0] * group, k_heads[1] * group),)),
        "in_proj_ba.weight": (0, ((k_heads[0] * 2 * per_k, k_heads[1] * 2 * per_k),)),
        "A_log": (0, (heads,)), "dt_bias": (0, (heads,)), "out_proj.weight": (1, (v,)),
    }
    hit = table.get(sub)
    return None if hit is None else ShardSpec(*hit)


def attn_spec(cfg: HybridConfig, s: AttnShard, sub: str) -> ShardSpec | None:
    hd = cfg.attn.head_dim
    qd = 2 * hd if cfg.attn.output_gate else hd  # q_proj rows per head ([query | gate] when gated)
    q = ((s.head_start * qd, (s.head_start + s.heads) * qd),)
    o = ((s.head_start * hd, (s.head_start + s.heads) * hd),)
    kv = ((s.kv_start * hd, (s.kv_start + s.kv_heads) * hd),)
    table = {"q_proj.weight": (0, q), "q_proj.bias": (0, q), "k_proj.weight": (0, kv), "k_proj.bias": (0, kv),
             "v_proj.weight": (0, kv), "v_proj.bias": (0, kv), "o_proj.weight": (1, o)}
    hit = table.get(sub)
    return None if hit is None else ShardSpec(*hit)


def mamba_spec(cfg: HybridConfig, s: MambaShard, sub: str) -> ShardSpec | None:
    inner, gn = cfg.mamba.intermediate, cfg.mamba.n_groups * cfg.mamba.d_state
    ch = (s.inner_start, s.inner_start + s.inner)
    g0 = s.groups[0] * s.d_state
    b = (g0, g0 + s.group_dim)
    heads = (s.head_start, s.head_start + s.heads)

    def off(r: Range, o: int) -> Range:
        return (r[0] + o, r[1] + o)

    conv = (ch, off(b, inner), off(b, inner + gn))  # x | B | C of the conv channels
    proj = (ch, off(ch, inner), off(b, 2 * inner), off(b, 2 * inner + gn), off(heads, 2 * inner + 2 * gn))
    table = {
        "in_proj.weight": (0, proj), "in_proj.bias": (0, proj),
        "conv1d.weight": (0, conv), "conv1d.bias": (0, conv),
        "A_log": (0, (heads,)), "D": (0, (heads,)), "dt_bias": (0, (heads,)),
        "norm.weight": (0, (ch,)), "out_proj.weight": (1, (ch,)),
    }
    hit = table.get(sub)
    return None if hit is None else ShardSpec(*hit)


def row_parallel(x: torch.Tensor, layer: Linear, tp: TPInfo) -> torch.Tensor:
    """A row-parallel projection: each rank multiplies its input columns, the partial sums are
    all-reduced, and the bias (replicated) is added once after the sum. One rank: `layer(x)`."""
    if tp.size == 1:
        return layer(x)
    out = tp.all_reduce(layer.matmul(x))
    return out if layer.bias is None else out + layer.bias


class SpanGatedRMSNorm(nn.Module):
    """Mamba2 gated RMSNorm over this rank's channels when a norm group spans ranks: the sums
    of squares of every group are all-reduced, so each rank normalises with the statistics of
    the whole group (the same numbers on every rank)."""

    def __init__(self, shard: MambaShard, n_groups: int, eps: float, tp: TPInfo,
                 dtype: torch.dtype, device: torch.device, before_gate: bool = False) -> None:
        super().__init__()
        self.before_gate = before_gate
        self.weight = empty_param(shard.inner, dtype=dtype, device=device)
        self.shard = shard
        self.derive_buffers(device)
        self.n_groups = n_groups
        self.group_size = shard.norm_group_size
        self.eps = eps
        self.tp = tp

    def derive_buffers(self, device: torch.device) -> None:
        """(Re)make the channel -> norm group map on `device` (see MambaMixer.derive_buffers)."""
        s = self.shard
        channels = torch.arange(s.inner_start, s.inner_start + s.inner, device=device)
        self.register_buffer("channel_group", channels // s.norm_group_size, persistent=False)

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y: [T, I/N] (float32 scan output), z: [T, I/N] gate -> [T, I/N] float32."""
        gate = F.silu(z.float())
        h = y.float() if self.before_gate else y.float() * gate
        sums = h.new_zeros(h.shape[0], self.n_groups)
        sums.index_add_(1, self.channel_group, h.pow(2))
        self.tp.all_reduce(sums)
        rstd = torch.rsqrt(sums / self.group_size + self.eps)
        out = self.weight.float() * (h * rstd[:, self.channel_group])
        return out * gate if self.before_gate else out
