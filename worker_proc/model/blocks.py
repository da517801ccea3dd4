"""`build_block`: the shared module of each block kind (shared.model_config.BLOCK_KINDS), with this
rank's sizes; the one place a block kind becomes a module. The decoder layers
(worker_proc.model.hybrid) build every block of a family's arrangement through it.
"""

from __future__ import annotations

import torch
from torch import nn

from shared.model_config import Block, HybridConfig
from worker_proc.model.attention import Attention
from worker_proc.model.gated_deltanet import GatedDeltaNet
from worker_proc.model.grouped_moe import GroupedSwigluMoE
from worker_proc.model.kimi_delta import KimiDeltaAttention
from worker_proc.model.latent_attention import LatentAttention
from worker_proc.model.layers import GatedMLP, Relu2MLP, SparseMoE, SplitGatedMLP
from worker_proc.model.mamba import MambaMixer
from worker_proc.model.mamba1 import Mamba1Mixer
from worker_proc.model.moe import SigmoidMoE
from worker_proc.model.qwen_moe import SharedGateMoE
from worker_proc.model.shard import TPInfo
from worker_proc.model.short_conv import ShortConv
from worker_proc.model.sigmoid_moe import SigmoidSwigluMoE

RECURRENT_MIXERS = (MambaMixer, GatedDeltaNet, ShortConv, KimiDeltaAttention, Mamba1Mixer)
"""The mixer modules that read and advance a recurrent state in the pools (`state_kind`)."""
ATTENTION_MIXERS = (Attention, LatentAttention)
"""The mixer modules that read and write their layer's KV pool."""


def build_block(block: Block, cfg: HybridConfig, dtype: torch.dtype, device: torch.device, tp: TPInfo) -> nn.Module:
    """The shared module of `block.kind`, with this rank's sizes."""
    hidden, width = cfg.hidden_size, block.size // tp.size
    if block.kind == "mamba":
        return MambaMixer(cfg, dtype, device, tp)
    if block.kind == "attention":
        return Attention(cfg, dtype, device, tp)
    if block.kind == "gdn":
        return GatedDeltaNet(cfg, dtype, device, tp)
    if block.kind == "short_conv":
        return ShortConv(cfg, dtype, device, tp)
    if block.kind == "mamba1":
        return Mamba1Mixer(cfg, dtype, device, tp)
    if block.kind == "kda":
        return KimiDeltaAttention(cfg, dtype, device, tp)
    if block.kind == "mla":
        return LatentAttention(cfg, dtype, device, tp)
    if block.kind == "grouped_swiglu_moe":
        return GroupedSwigluMoE(cfg, block.size, dtype, device, tp)
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
    if block.kind == "sigmoid_swiglu_moe":
        return SigmoidSwigluMoE(cfg, block.size, dtype, device, tp)
    raise ValueError(f"unknown block kind {block.kind!r}")


def cfg_mlp_multipliers(cfg: HybridConfig) -> tuple[float, float]:
    return cfg.mlp.multipliers if cfg.mlp.multipliers else (1.0, 1.0)
