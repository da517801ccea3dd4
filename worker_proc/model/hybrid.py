"""`HybridForCausalLM`: the GraniteMoeHybrid decoder over one flattened step.

Module/parameter names mirror `GraniteMoeHybridForCausalLM` so the
checkpoint's tensor names are this module's `state_dict` keys. Per layer:

    r = h; h = mixer(input_layernorm(h)); h = r + h * residual_multiplier
    r = h; x = post_attention_layernorm(h); h = r + (moe(x) + shared_mlp(x)) * residual_multiplier

with embeddings scaled by `embedding_multiplier` and logits divided by `logits_scaling`.
Tensor parallelism: the constructor takes `tp`; every module is built with this rank's sizes and
the loader reads each parameter's slice through `shard_spec` (rules in worker_proc.model.tp).
Row-parallel outputs are all-reduced inside the layer, so the residual stream `h` is whole and
identical on every rank; embedding and LM head are replicated (every rank computes the logits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shared.errors import ModelLoadError
from worker_proc.kernels import KernelOps
from worker_proc.model.attention import Attention, rope_cos_sin
from worker_proc.model.batch import StepBatch
from worker_proc.model.config import HybridConfig, tp_layout_error
from worker_proc.model.layers import MIN_GEMM_ROWS, GatedMLP, Linear, RMSNorm, SparseMoE, _empty, linear
from worker_proc.model.mamba import MambaMixer
from worker_proc.model.tp import ShardSpec, TPInfo, shard_spec
from worker_proc.pools import StatePools

__all__ = ["DecoderLayer", "HybridForCausalLM", "HybridModel", "TPInfo"]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: HybridConfig, index: int, dtype: torch.dtype, device: torch.device, tp: TPInfo) -> None:
        super().__init__()
        self.tp = tp
        self.kind = cfg.layer_kinds[index]
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        if self.kind == "mamba":
            self.mamba = MambaMixer(cfg, dtype, device, tp)
            self.pool_index = cfg.mamba_layer_ids.index(index)
        else:
            self.self_attn = Attention(cfg, dtype, device, tp)
            self.pool_index = cfg.attn_layer_ids.index(index)
        shared, moe = cfg.shared_intermediate_size // tp.size, cfg.intermediate_size // tp.size
        self.shared_mlp = GatedMLP(cfg.hidden_size, shared, dtype, device)
        self.block_sparse_moe = (
            SparseMoE(cfg.hidden_size, moe, cfg.num_experts, cfg.num_experts_per_tok, dtype, device)
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
        mlp = self.tp.all_reduce(mlp)  # MLP and MoE are row-parallel: one sum of both partials
        return h + mlp * self.residual_multiplier


class HybridModel(nn.Module):
    def __init__(self, cfg: HybridConfig, dtype: torch.dtype, device: torch.device, tp: TPInfo) -> None:
        super().__init__()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = _empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, device, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


class HybridForCausalLM(nn.Module):
    """The whole model. `forward_step` is the only entry point the runtime calls."""

    def __init__(
        self, cfg: HybridConfig, dtype: torch.dtype, device: torch.device | str, tp: TPInfo | None = None
    ) -> None:
        super().__init__()
        self.tp = tp or TPInfo()
        if not 0 <= self.tp.rank < self.tp.size:
            raise ValueError(f"tensor-parallel rank {self.tp.rank} outside [0, {self.tp.size})")
        problem = tp_layout_error(cfg, self.tp.size)
        if problem:
            raise ModelLoadError(problem)
        device = torch.device(device)
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.model = HybridModel(cfg, dtype, device, self.tp)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, device=device)
        )
        self.min_rows = 0

    def shard_spec(self, name: str) -> ShardSpec | None:
        """Which slice of checkpoint tensor `name` (parameter name) this rank holds; None = whole."""
        return shard_spec(self.cfg, self.tp, name)

    def shard_for_rank(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The part of the whole checkpoint tensor `name` this rank holds."""
        spec = self.shard_spec(name)
        return tensor if spec is None else spec.apply(tensor)

    def set_batch_invariant(self, on: bool) -> None:
        """Deterministic mode: pad every CPU GEMM to MIN_GEMM_ROWS rows so a row's result does not
        depend on what it is batched with (see `layers.linear`); off: plain GEMMs (the default)."""
        rows = MIN_GEMM_ROWS if on else 0
        self.min_rows = rows
        for module in self.modules():
            if isinstance(module, (Linear, SparseMoE)):
                module.min_rows = rows

    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.inference_mode()
    def forward_step(
        self, batch: StepBatch, pools: StatePools, ops: KernelOps, want_logits: bool = True
    ) -> torch.Tensor:
        """Run every layer over the step's rows, writing KV and advancing Mamba state in place.
        Returns float32 logits [len(batch.logit_rows), vocab] (already divided by logits_scaling);
        with `want_logits=False` (ranks that do not sample) the LM head is skipped: [0, vocab]."""
        cfg = self.cfg
        h = F.embedding(batch.input_ids, self.model.embed_tokens.weight) * cfg.embedding_multiplier
        rope = None
        if cfg.rope_theta is not None and cfg.attn_layer_ids:
            rope = rope_cos_sin(batch.positions, cfg.head_dim, cfg.rope_theta, self.dtype)
        for layer in self.model.layers:
            h = layer(h, batch, rope, pools, ops)
        if not want_logits:
            return h.new_empty(0, cfg.vocab_size, dtype=torch.float32)
        h = self.model.norm(h[batch.logit_rows])
        return linear(h, self.lm_head_weight(), min_rows=self.min_rows).float() / cfg.logits_scaling
