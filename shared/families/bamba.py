"""BambaForCausalLM (IBM Bamba-9B): a Mamba2 or attention mixer (`mamba` / `self_attn` after
`input_layernorm`), then a split gated SiLU MLP (`feed_forward` after `pre_ff_layernorm`) in every
layer. Attention layers are listed by `attn_layer_indices` (or `layers_block_type`); attention
uses RoPE on the first `partial_rotary_factor` (0.5) of each head, scale 1/sqrt(head_dim). The
final norm `model.final_layernorm` maps onto the shared `model.norm`."""

from __future__ import annotations

from shared.families.common import dtype_name, mamba_part
from shared.families.family import Family
from shared.families.fields import check_act, check_attention, max_positions, num, rope_theta, rotary_fraction
from shared.model_config import AttentionConfig, Block, HybridConfig, MlpConfig, Sublayer

RENAMES = ((r"^model\.final_layernorm\.", "model.norm."),)


def layer_kinds(cfg: dict) -> tuple[str, ...]:
    n = int(cfg["num_hidden_layers"])
    raw = cfg.get("layers_block_type") or cfg.get("layer_types")
    if raw:
        kinds = tuple("attention" if k in ("attention", "full_attention") else "mamba" for k in raw)
    else:
        attn = set(int(i) for i in cfg.get("attn_layer_indices") or ())
        bad = sorted(i for i in attn if not 0 <= i < n)
        if bad:
            raise ValueError(f"attn_layer_indices {bad[0]} outside [0, num_hidden_layers={n})")
        kinds = tuple("attention" if i in attn else "mamba" for i in range(n))
    if len(kinds) != n:
        raise ValueError(f"{len(kinds)} layer types for num_hidden_layers={n}")
    return kinds


def attention_part(cfg: dict, rotary_default: float, **extra: object) -> AttentionConfig:
    """RoPE attention on the first `partial_rotary_factor` of each head (Bamba, Falcon-H1); `extra`:
    the family's own attention settings."""
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    check_attention(heads, kv_heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    rotary = int(head_dim * rotary_fraction(cfg, rotary_default))
    if rotary % 2 or not 0 < rotary <= head_dim:
        raise ValueError(f"partial_rotary_factor gives {rotary} rotary channels of head_dim {head_dim}")
    return AttentionConfig(
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, bias=bool(cfg.get("attention_bias")),
        scale=head_dim**-0.5, rope_theta=rope_theta(cfg, True), rotary_dim=rotary, **extra,  # type: ignore[arg-type]
    )


def parse(cfg: dict, arch: str) -> HybridConfig:
    hidden = int(cfg["hidden_size"])
    check_act(cfg, "hidden_act", "silu")
    kinds = layer_kinds(cfg)
    ffn = Sublayer("pre_ff_layernorm", (Block("gated_mlp", "feed_forward", int(cfg["intermediate_size"]),
                                              "intermediate_size"),))
    mixers = {"mamba": Block("mamba", "mamba"), "attention": Block("attention", "self_attn")}
    return HybridConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        layer_kinds=kinds,
        rms_norm_eps=num(cfg, "rms_norm_eps", 1e-5),
        max_position_embeddings=max_positions(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        torch_dtype=dtype_name(cfg),
        layer_specs=tuple((Sublayer("input_layernorm", (mixers[k],)), ffn) for k in kinds),
        attn=attention_part(cfg, 0.5),
        mamba=mamba_part(cfg, int(cfg.get("mamba_expand", 2)) * hidden),
        mlp=MlpConfig(bias=bool(cfg.get("mlp_bias", False))),
        renames=RENAMES,
    )


FAMILY = Family(parse, layer_kinds)
