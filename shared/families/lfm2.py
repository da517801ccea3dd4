"""LFM2 and LFM2-MoE (Liquid AI, `Lfm2ForCausalLM`, `Lfm2MoeForCausalLM`): gated short convolutions
interleaved with GQA attention.

Every layer: RMSNorm `operator_norm` -> mixer -> residual, then `ffn_norm` -> `feed_forward` ->
residual; the final norm is `embedding_norm` (mapped onto `model.norm`). The mixer (`layer_types`:
"conv" or "full_attention"; without them the layers in `full_attn_idxs` are attention, every layer
when that is absent too) is a gated short convolution (`conv`, worker_proc.model.short_conv: in_proj
-> B, C, x; causal depthwise conv of width `conv_L_cache` over B * x, no activation; C * conv ->
out_proj; `conv_bias` on all three) or attention (`self_attn`: plain RMSNorm `q_layernorm` /
`k_layernorm` per head before full RoPE, scale 1/sqrt(head_dim), `out_proj`). The `feed_forward`
is a SwiGLU `w2(silu(w1(x)) * w3(x))` whose width `block_auto_adjust_ff_dim` derives from
`intermediate_size` (`block_ff_dim` in the hub's configs) as transformers does: 2/3 of it, times
`block_ffn_dim_multiplier`, rounded up to `block_multiple_of`. The head is tied unless
`tie_embedding` / `tie_word_embeddings` is false. The checkpoint's names map onto the shared
blocks' (`RENAMES`).
LFM2-MoE: the first `num_dense_layers` layers' `feed_forward` is that SwiGLU at `intermediate_size` as
given; every later one is a sigmoid-routed MoE of `num_experts` SwiGLU experts of
`moe_intermediate_size` (worker_proc.model.sigmoid_moe: top `num_experts_per_tok` chosen with the
`expert_bias` added when `use_expert_bias`, weights normalised with `norm_topk_prob`, times
`routed_scaling_factor`; per-expert `w1` / `w3` / `w2` tensors).
"""

from __future__ import annotations

from shared.families.common import dtype_name
from shared.families.family import Family
from shared.families.fields import check_attention, max_positions, num, rope_theta
from shared.model_config import AttentionConfig, Block, HybridConfig, MoeConfig, ShortConvConfig, Sublayer

DEFAULT_ROPE_THETA = 1_000_000.0  # transformers' Lfm2Config.default_theta
MOE_ARCH = "Lfm2MoeForCausalLM"
_KINDS = {"conv": "short_conv", "full_attention": "attention"}
RENAMES = (
    (r"^model\.embedding_norm\.", "model.norm."),
    (r"\.self_attn\.out_proj\.", ".self_attn.o_proj."),
    (r"\.self_attn\.q_layernorm\.", ".self_attn.q_norm."),
    (r"\.self_attn\.k_layernorm\.", ".self_attn.k_norm."),
    (r"\.feed_forward\.w1\.", ".feed_forward.gate_proj."),
    (r"\.feed_forward\.w3\.", ".feed_forward.up_proj."),
    (r"\.feed_forward\.w2\.", ".feed_forward.down_proj."),
    (r"\.feed_forward\.experts\.(\d+)\.w1\.", r".feed_forward.experts.\1.gate_proj."),
    (r"\.feed_forward\.experts\.(\d+)\.w3\.", r".feed_forward.experts.\1.up_proj."),
    (r"\.feed_forward\.experts\.(\d+)\.w2\.", r".feed_forward.experts.\1.down_proj."),
)
"""LFM2 checkpoint names -> the shared blocks' parameter names."""


def layer_kinds(cfg: dict) -> tuple[str, ...]:
    n = int(cfg["num_hidden_layers"])
    raw = cfg.get("layer_types")
    if raw is None:
        idxs = cfg.get("full_attn_idxs")
        attn = set(range(n)) if idxs is None else {int(i) for i in idxs}
        raw = ["full_attention" if i in attn else "conv" for i in range(n)]
    bad = [t for t in raw if t not in _KINDS]
    if bad:
        raise ValueError(f"unknown layer_types entry {bad[0]!r} (one of {', '.join(_KINDS)})")
    if len(raw) != n:
        raise ValueError(f"{len(raw)} layer_types for num_hidden_layers={n}")
    return tuple(_KINDS[t] for t in raw)


def ff_width(cfg: dict, arch: str = "Lfm2ForCausalLM") -> int:
    """The SwiGLU width transformers' Lfm2MLP derives from the config (Lfm2MoeMLP: `intermediate_size`)."""
    width = int(cfg.get("block_ff_dim") or cfg["intermediate_size"])
    if arch == MOE_ARCH or not cfg.get("block_auto_adjust_ff_dim", True):
        return width
    width = int(2 * width / 3)
    multiplier = cfg.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is not None:
        multiple = int(cfg.get("block_multiple_of", 256))
        width = int(float(multiplier) * width)
        width = multiple * ((width + multiple - 1) // multiple)
    return width


def _attention_part(cfg: dict) -> AttentionConfig:
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    check_attention(heads, kv_heads)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    return AttentionConfig(
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, scale=head_dim**-0.5,
        rope_theta=rope_theta({"rope_theta": DEFAULT_ROPE_THETA, **cfg}, True), qk_norm=True,
    )


def _ff_blocks(cfg: dict, arch: str, n: int) -> tuple[tuple[Block, ...], MoeConfig]:
    """The `feed_forward` block of every layer and the MoE part (LFM2-MoE's)."""
    dense = Block("gated_mlp", "feed_forward", ff_width(cfg, arch), "intermediate_size")
    if arch != MOE_ARCH:
        return (dense,) * n, MoeConfig()
    experts, top_k = int(cfg.get("num_experts", 32)), int(cfg.get("num_experts_per_tok", 4))
    if not 0 < top_k <= experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be in [1, num_experts={experts}]")
    moe = Block("sigmoid_swiglu_moe", "feed_forward", int(cfg.get("moe_intermediate_size", 1792)),
                "moe_intermediate_size")
    dense_layers = int(cfg.get("num_dense_layers", 2))
    part = MoeConfig(num_experts=experts, experts_per_tok=top_k, norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                     routed_scaling=num(cfg, "routed_scaling_factor", 1.0),
                     choice_bias=bool(cfg.get("use_expert_bias", True)))
    return tuple(dense if i < dense_layers else moe for i in range(n)), part


def parse(cfg: dict, arch: str) -> HybridConfig:
    kinds = layer_kinds(cfg)
    d_conv = int(cfg.get("conv_L_cache", 3))
    if d_conv < 2:
        raise ValueError(f"conv_L_cache {d_conv} must be at least 2 (the conv keeps the last {d_conv - 1} inputs)")
    ffs, moe = _ff_blocks(cfg, arch, len(kinds))
    mixers = {"short_conv": Block("short_conv", "conv"), "attention": Block("attention", "self_attn")}
    specs = tuple((Sublayer("operator_norm", (mixers[k],)), Sublayer("ffn_norm", (ff,)))
                  for k, ff in zip(kinds, ffs, strict=True))
    tie = cfg.get("tie_embedding", cfg.get("tie_word_embeddings", True))
    return HybridConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        layer_kinds=kinds,
        rms_norm_eps=num(cfg, "norm_eps", 1e-5),
        max_position_embeddings=max_positions(cfg),
        tie_word_embeddings=bool(tie),
        torch_dtype=dtype_name(cfg),
        layer_specs=specs,
        attn=_attention_part(cfg),
        short_conv=ShortConvConfig(d_conv=d_conv, bias=bool(cfg.get("conv_bias", False))),
        moe=moe,
        renames=RENAMES,
    )


FAMILY = Family(parse, layer_kinds)
