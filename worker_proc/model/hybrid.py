"""`HybridForCausalLM`: one decoder for every family, assembled from the shared blocks as the
family's `HybridConfig.layers()` arranges them, over one flattened step.

Per layer, for each `Sublayer` (shared.model_config):

    h = h + multiplier * sum(out_multiplier * block(in_multiplier * norm(h)) for block in blocks)

with embeddings scaled by `embedding_multiplier` and logits multiplied by `lm_head_multiplier`
and divided by `logits_scaling`. Module names are the blocks' names under `model.layers.N`, so the
checkpoint's tensor names (after the family's renames, applied by the loader) are this module's
`state_dict` keys: `model.embed_tokens`, `model.layers.N.<norm>`, `model.layers.N.<block>.*`,
`model.norm`, `lm_head`.
Recurrent mixers (Mamba2, Gated DeltaNet) read and advance their layer's tensors of the worker's
state pools (`pools.layer_state(kind, i)`, the same way for every recurrent mixer kind: the conv
windows and the recurrent state in its storage dtype, int8 values with their scales) at the
request's state slot; attention its layer's KV pool.
Tensor parallelism: the constructor takes `tp`; every block is built with this rank's sizes and
names the slice of each of its tensors (`shard_spec`, rules in worker_proc.model.tp). Mixers
all-reduce their own output; MLP and MoE blocks return partial sums, all-reduced once per
sublayer. The residual stream `h` is whole and identical on every rank; embedding, norms and LM
head are replicated (every rank computes the logits).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from shared.errors import ModelLoadError
from shared.model_config import Block, HybridConfig, Sublayer, tp_layout_error
from worker_proc.kernels import KernelOps
from worker_proc.model.attention import Attention, rope_cos_sin
from worker_proc.model.batch import StepBatch
from worker_proc.model.gated_deltanet import GatedDeltaNet
from worker_proc.model.gemm import GemmOwner, GemmSite
from worker_proc.model.layers import GatedMLP, Linear, Relu2MLP, SparseMoE, SplitGatedMLP, empty_param, make_norm
from worker_proc.model.mamba import MambaMixer
from worker_proc.model.moe import SigmoidMoE
from worker_proc.model.quantized import QuantizedWeight
from worker_proc.model.qwen_moe import SharedGateMoE
from worker_proc.model.shard import ShardSpec, TPInfo
from worker_proc.pools import StatePools

__all__ = ["DecoderLayer", "HybridForCausalLM", "HybridModel", "TPInfo"]

_LAYER_PARAM = re.compile(r"^model\.layers\.(\d+)\.([^.]+)\.(.+)$")


def build_block(block: Block, cfg: HybridConfig, dtype: torch.dtype, device: torch.device, tp: TPInfo) -> nn.Module:
    """The shared module of `block.kind`, with this rank's sizes."""
    hidden, width = cfg.hidden_size, block.size // tp.size
    if block.kind == "mamba":
        return MambaMixer(cfg, dtype, device, tp)
    if block.kind == "attention":
        return Attention(cfg, dtype, device, tp)
    if block.kind == "gdn":
        return GatedDeltaNet(cfg, dtype, device, tp)
    if block.kind == "fused_gated_mlp":
        return GatedMLP(hidden, width, dtype, device, tp)
    if block.kind == "gated_mlp":
        return SplitGatedMLP(hidden, width, cfg.mlp.bias, dtype, device, tp, *cfg_mlp_multipliers(cfg))
    if block.kind == "relu2_mlp":
        return Relu2MLP(hidden, width, dtype, device, tp)
    if block.kind == "softmax_moe":
        return SparseMoE(hidden, width, cfg.moe.num_experts, cfg.moe.experts_per_tok, dtype, device, tp)
    if block.kind == "sigmoid_moe":
        return SigmoidMoE(cfg, block.size, dtype, device, tp)
    if block.kind == "shared_gate_moe":
        return SharedGateMoE(cfg, block.size, dtype, device, tp)
    raise ValueError(f"unknown block kind {block.kind!r}")


def cfg_mlp_multipliers(cfg: HybridConfig) -> tuple[float, float]:
    return cfg.mlp.multipliers if cfg.mlp.multipliers else (1.0, 1.0)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: HybridConfig, index: int, dtype: torch.dtype, device: torch.device, tp: TPInfo) -> None:
        super().__init__()
        self.tp = tp
        self.subs: tuple[Sublayer, ...] = cfg.layers()[index]
        self.kind = cfg.layer_kinds[index]
        for sub in self.subs:
            self.add_module(sub.norm, make_norm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, cfg.norm_unit_offset,
                                                cfg.norm_fp32_weight))
            for block in sub.blocks:
                self.add_module(block.name, build_block(block, cfg, dtype, device, tp))
        self.attn_index = cfg.attn_layer_ids.index(index) if index in cfg.attn_layer_ids else -1
        # this layer's index among the layers of each recurrent kind that it has
        self.state_index = {kind: ids.index(index) for kind, ids in (("mamba", cfg.mamba_layer_ids),
                                                                     ("gdn", cfg.gdn_layer_ids)) if index in ids}

    def _run(self, module: nn.Module, x: torch.Tensor, batch: StepBatch,
             rope: tuple[torch.Tensor, torch.Tensor] | None, pools: StatePools, ops: KernelOps) -> torch.Tensor:
        if isinstance(module, MambaMixer | GatedDeltaNet):
            conv, state = pools.layer_state(module.state_kind, self.state_index[module.state_kind])
            return module(x, batch, conv, state, ops)
        if isinstance(module, Attention):
            i = self.attn_index
            return module(x, batch, rope, pools.k[i], pools.v[i], ops)
        return module(x)

    def forward(
        self,
        h: torch.Tensor,
        batch: StepBatch,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        pools: StatePools,
        ops: KernelOps,
    ) -> torch.Tensor:
        for sub in self.subs:
            x = getattr(self, sub.norm)(h)
            whole: torch.Tensor | None = None  # sum of all-reduced block outputs
            partial: torch.Tensor | None = None  # sum of this rank's partial sums
            for block in sub.blocks:
                module = getattr(self, block.name)
                out = self._run(module, x if block.in_multiplier == 1.0 else x * block.in_multiplier,
                                batch, rope, pools, ops)
                if block.out_multiplier != 1.0:
                    out = out * block.out_multiplier
                if module.reduced:
                    whole = out if whole is None else whole + out
                else:
                    partial = out if partial is None else partial + out
            if partial is not None:
                partial = self.tp.all_reduce(partial)  # one sum of every MLP/MoE partial
            y = partial if whole is None else (whole if partial is None else whole + partial)
            h = h + y if sub.multiplier == 1.0 else torch.add(h, y, alpha=sub.multiplier)
        return h


class HybridModel(nn.Module):
    def __init__(self, cfg: HybridConfig, dtype: torch.dtype, device: torch.device, tp: TPInfo) -> None:
        super().__init__()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = empty_param(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, device, tp) for i in range(cfg.num_layers))
        self.norm = make_norm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, cfg.norm_unit_offset,
                              cfg.norm_fp32_weight)


class HybridForCausalLM(nn.Module, GemmOwner):
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
        self.head_gemm = GemmSite(cfg.vocab_size, cfg.hidden_size, dtype, packable=True)  # a tied LM head
        self.embed_rows: QuantizedWeight | None = None
        """The quantized rows the embedding lookups read once a tied head is quantized (the table's dense
        copy is then gone; worker_proc.quantization)."""

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of `ids` in the model dtype."""
        q = self.embed_rows
        if q is None:
            return F.embedding(ids, self.model.embed_tokens.weight)
        return (q.data[ids].float() * q.scale[ids][:, None]).to(self.dtype)

    def shard_spec(self, name: str) -> ShardSpec | None:
        """Which slice of checkpoint tensor `name` (parameter name) this rank holds; None = whole.
        The block owning the tensor decides; embedding, norms and LM head are replicated."""
        if self.tp.size == 1:
            return None
        m = _LAYER_PARAM.match(name)
        if m is None:
            return None
        layers = self.model.layers
        index = int(m.group(1))
        module = getattr(layers[index], m.group(2), None) if index < len(layers) else None
        spec = getattr(module, "shard_spec", None)
        return spec(m.group(3)) if callable(spec) else None

    def shard_for_rank(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The part of the whole checkpoint tensor `name` this rank holds."""
        spec = self.shard_spec(name)
        return tensor if spec is None else spec.apply(tensor)

    def gemm_weights(self) -> Iterator[tuple[GemmSite, nn.Module, str]]:
        """A tied LM head's site over the embedding table."""
        if self.lm_head is None:
            yield self.head_gemm, self.model.embed_tokens, "weight"

    @torch.inference_mode()
    def forward_step(
        self, batch: StepBatch, pools: StatePools, ops: KernelOps, want_logits: bool = True
    ) -> torch.Tensor:
        """Run every layer over the step's rows, writing KV and advancing recurrent state in place.
        Returns float32 logits [len(batch.logit_rows), vocab] (already scaled); with
        `want_logits=False` (ranks that do not sample) the LM head is skipped: [0, vocab]."""
        cfg = self.cfg
        h = self.embed(batch.input_ids)
        if cfg.embedding_multiplier != 1.0:
            h = h * cfg.embedding_multiplier
        rope = None
        if cfg.attn.rope_theta is not None and cfg.attn_layer_ids:
            rope = rope_cos_sin(batch.positions, cfg.attn.rope_dim, cfg.attn.rope_theta, self.dtype)
        for layer in self.model.layers:
            h = layer(h, batch, rope, pools, ops)
        if not want_logits:
            return h.new_empty(0, cfg.vocab_size, dtype=torch.float32)
        h = self.model.norm(h[batch.logit_rows])
        if self.lm_head is not None:
            logits = self.lm_head(h).float()
        else:
            logits = self.head_gemm.apply(h, self.model.embed_tokens.weight).float()
        if cfg.lm_head_multiplier != 1.0:
            logits = logits * cfg.lm_head_multiplier
        return logits / cfg.logits_scaling
