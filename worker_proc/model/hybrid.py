"""`HybridForCausalLM`: the GraniteMoeHybrid decoder over one flattened step.

Owned by the worker runtime. Module/parameter names mirror `GraniteMoeHybridForCausalLM` so the
checkpoint's tensor names are this module's `state_dict` keys. Per layer:

    r = h; h = mixer(input_layernorm(h)); h = r + h * residual_multiplier
    r = h; x = post_attention_layernorm(h); h = r + (moe(x) + shared_mlp(x)) * residual_multiplier

with embeddings scaled by `embedding_multiplier` and logits divided by `logits_scaling`.
Tensor parallelism: the constructor takes `tp` and every parameter is loaded through
`shard_for_rank` (identity for one rank), so sharding plugs in without changing the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from worker_proc.kernels import KernelOps
from worker_proc.model.attention import Attention, rope_cos_sin
from worker_proc.model.batch import StepBatch
from worker_proc.model.config import HybridConfig
from worker_proc.model.layers import GatedMLP, Linear, RMSNorm, SparseMoE, _empty, linear
from worker_proc.model.mamba import MambaMixer
from worker_proc.pools import StatePools


@dataclass(frozen=True)
class TPInfo:
    """This rank's place in the tensor-parallel group (group = a torch.distributed group or None)."""

    rank: int = 0
    size: int = 1
    group: Any = None


class DecoderLayer(nn.Module):
    def __init__(self, cfg: HybridConfig, index: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.kind = cfg.layer_kinds[index]
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        if self.kind == "mamba":
            self.mamba = MambaMixer(cfg, dtype, device)
            self.pool_index = cfg.mamba_layer_ids.index(index)
        else:
            self.self_attn = Attention(cfg, dtype, device)
            self.pool_index = cfg.attn_layer_ids.index(index)
        self.shared_mlp = GatedMLP(cfg.hidden_size, cfg.shared_intermediate_size, dtype, device)
        self.block_sparse_moe = (
            SparseMoE(cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.num_experts_per_tok, dtype, device)
            if cfg.num_experts > 0
            else None
        )
        self.residual_multiplier = cfg.residual_multiplier

    def forward(
        self,
        h: torch.Tensor,
        batch: StepBatch,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        pools: StatePools,
        ops: KernelOps,
    ) -> torch.Tensor:
        x = self.input_layernorm(h)
        i = self.pool_index
        if self.kind == "mamba":
            x = self.mamba(x, batch, pools.conv[i], pools.ssm[i], ops)
        else:
            x = self.self_attn(x, batch, rope, pools.k[i], pools.v[i], ops)
        h = h + x * self.residual_multiplier
        x = self.post_attention_layernorm(h)
        mlp = self.shared_mlp(x)
        if self.block_sparse_moe is not None:
            mlp = self.block_sparse_moe(x) + mlp
        return h + mlp * self.residual_multiplier


class HybridModel(nn.Module):
    def __init__(self, cfg: HybridConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = _empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, device) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


class HybridForCausalLM(nn.Module):
    """The whole model. `forward_step` is the only entry point the runtime calls."""

    def __init__(
        self, cfg: HybridConfig, dtype: torch.dtype, device: torch.device | str, tp: TPInfo | None = None
    ) -> None:
        super().__init__()
        self.tp = tp or TPInfo()
        if self.tp.size != 1:
            raise NotImplementedError("tensor parallelism (tp_size > 1) is not implemented yet")
        device = torch.device(device)
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.model = HybridModel(cfg, dtype, device)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, device=device)
        )

    def shard_for_rank(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The part of checkpoint tensor `name` this rank holds. The per-parameter hook where tensor
        parallel sharding goes; with one rank every tensor is held whole."""
        del name
        return tensor

    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.inference_mode()
    def forward_step(self, batch: StepBatch, pools: StatePools, ops: KernelOps) -> torch.Tensor:
        """Run every layer over the step's rows, writing KV and advancing Mamba state in place.
        Returns float32 logits [len(batch.logit_rows), vocab] (already divided by logits_scaling)."""
        cfg = self.cfg
        h = F.embedding(batch.input_ids, self.model.embed_tokens.weight) * cfg.embedding_multiplier
        rope = None
        if cfg.rope_theta is not None and cfg.attn_layer_ids:
            rope = rope_cos_sin(batch.positions, cfg.head_dim, cfg.rope_theta, self.dtype)
        for layer in self.model.layers:
            h = layer(h, batch, rope, pools, ops)
        h = self.model.norm(h[batch.logit_rows])
        return linear(h, self.lm_head_weight()).float() / cfg.logits_scaling
