"""Jamba (AI21, `JambaForCausalLM`): Mamba1 layers interleaved with attention, dense and MoE feed-forwards.

Every layer: RMSNorm `input_layernorm` -> mixer -> residual, then `pre_ff_layernorm` -> `feed_forward` ->
residual; the final norm is `final_layernorm` (mapped onto `model.norm`). Layer i's mixer is attention
(`self_attn`: GQA, no positional encoding, scale 1/sqrt(head_dim), no biases) when
i % `attn_layer_period` == `attn_layer_offset`, else Mamba1 (`mamba`, worker_proc.model.mamba1: d_inner =
`mamba_expand` * hidden, `mamba_d_state`, `mamba_d_conv`, `mamba_dt_rank` ("auto": ceil(hidden / 16)),
`mamba_conv_bias`, `mamba_proj_bias`, with weighted RMS norms `dt_layernorm` / `b_layernorm` /
`c_layernorm` of epsilon `rms_norm_eps` on dt, B and C). Layer i's feed-forward is the sparse MoE when
i % `expert_layer_period` == `expert_layer_offset` and `num_experts` > 1 (the shared `shared_gate_moe`
block without a shared expert: softmax over every expert's router logit, the top `num_experts_per_tok`
taken with those probabilities, not renormalised; the checkpoint's `router` is the block's `gate`), else a
SwiGLU MLP; both of width `intermediate_size`. The head is untied unless `tie_word_embeddings`.
"""

from __future__ import annotations

from shared.families.common import dtype_name
from shared.families.family import Family
from shared.families.fields import check_act, check_attention, max_positions, num
from shared.families.mamba1 import check_mamba1, dt_rank
from shared.model_config import AttentionConfig, Block, HybridConfig, Mamba1Config, MoeConfig, Sublayer

RENAMES = (
    (r"^model\.final_layernorm\.", "model.norm."),
    (r"\.feed_forward\.router\.", ".feed_forward.gate."),
)
"""Jamba checkpoint names -> the shared blocks' parameter names."""


def layer_kinds(cfg: dict) -> tuple[str, ...]:
    period, offset = int(cfg.get("attn_layer_period", 8)), int(cfg.get("attn_layer_offset", 4))
    if not 0 <= offset < period:
        raise ValueError(f"attn_layer_offset {offset} must be in [0, attn_layer_period {period})")
    return tuple("attention" if i % period == offset else "mamba1" for i in range(int(cfg["num_hidden_layers"])))


def expert_layers(cfg: dict) -> tuple[bool, ...]:
    """Which layers' feed-forward is the MoE (transformers' `layers_num_experts` > 1)."""
    period, offset = int(cfg.get("expert_layer_period", 2)), int(cfg.get("expert_layer_offset", 1))
    if not 0 <= offset < period:
        raise ValueError(f"expert_layer_offset {offset} must be in [0, expert_layer_period {period})")
    many = int(cfg.get("num_experts", 16)) > 1
    return tuple(many and i % period == offset for i in range(int(cfg["num_hidden_layers"])))


def _attention_part(cfg: dict) -> AttentionConfig:
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    check_attention(heads, kv_heads)
    head_dim = int(cfg["hidden_size"]) // heads
    return AttentionConfig(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, scale=head_dim**-0.5,
                           rope_theta=None)  # fmt: skip


def _mamba1_part(cfg: dict) -> Mamba1Config:
    hidden = int(cfg["hidden_size"])
    part = Mamba1Config(
        d_inner=int(cfg.get("mamba_expand", 2)) * hidden, d_state=int(cfg.get("mamba_d_state", 16)),
        d_conv=int(cfg.get("mamba_d_conv", 4)), dt_rank=dt_rank(cfg.get("mamba_dt_rank"), hidden),
        conv_bias=bool(cfg.get("mamba_conv_bias", True)), proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        bcdt_norm="weighted", norm_eps=num(cfg, "rms_norm_eps", 1e-6), inner_field="mamba_expand * hidden_size",
    )
    check_mamba1(part)
    return part


def parse(cfg: dict, arch: str) -> HybridConfig:
    check_act(cfg, "hidden_act", "silu")
    kinds = layer_kinds(cfg)
    width = int(cfg["intermediate_size"])
    mixers = {"mamba1": Block("mamba1", "mamba"), "attention": Block("attention", "self_attn")}
    ffn = {True: Block("shared_gate_moe", "feed_forward", width, "intermediate_size"),
           False: Block("gated_mlp", "feed_forward", width, "intermediate_size")}
    specs = tuple((Sublayer("input_layernorm", (mixers[k],)), Sublayer("pre_ff_layernorm", (ffn[moe],)))
                  for k, moe in zip(kinds, expert_layers(cfg), strict=True))
    top_k = int(cfg.get("num_experts_per_tok", 2))
    routed = MoeConfig(num_experts=int(cfg.get("num_experts", 16)), experts_per_tok=top_k, norm_topk_prob=False)
    return HybridConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        layer_kinds=kinds,
        rms_norm_eps=num(cfg, "rms_norm_eps", 1e-6),
        max_position_embeddings=max_positions(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        torch_dtype=dtype_name(cfg),
        layer_specs=specs,
        attn=_attention_part(cfg) if "attention" in kinds else AttentionConfig(),
        mamba1=_mamba1_part(cfg),
        moe=routed if any(expert_layers(cfg)) else MoeConfig(),
        renames=RENAMES,
    )


FAMILY = Family(parse, layer_kinds)
