"""GraniteMoeHybridForCausalLM (IBM Granite 4.0-H): Mamba2 or attention mixer, then a fused
gated MLP (+ an optional softmax top-k MoE) in every layer; muP scalars on embeddings, residuals,
attention scale and logits (`arrangement`)."""

from __future__ import annotations

from shared.errors import ModelLoadError
from shared.families.common import mamba_part
from shared.families.family import Family
from shared.families.fields import check_act, check_attention, max_positions, num, rope_theta
from shared.model_config import AttentionConfig, Block, HybridConfig, MoeConfig, Sublayer

_MAMBA_KINDS = {"mamba": "mamba", "linear_attention": "mamba", "mamba2": "mamba"}
_ATTN_KINDS = {"attention": "attention", "full_attention": "attention"}
# transformers>=5 in-memory names -> checkpoint names
RENAMES = (
    (r"\.block_sparse_moe\.experts\.gate_up_proj$", ".block_sparse_moe.input_linear.weight"),
    (r"\.block_sparse_moe\.experts\.down_proj$", ".block_sparse_moe.output_linear.weight"),
    (r"\.block_sparse_moe\.router\.weight$", ".block_sparse_moe.router.layer.weight"),
)


def layer_kinds(cfg: dict) -> tuple[str, ...]:
    """Per-layer mixer kinds ("mamba" | "attention") from layer_types or layers_block_type."""
    raw = cfg.get("layer_types") or cfg.get("layers_block_type")
    n = int(cfg.get("num_hidden_layers", 0))
    if raw is None:
        raise ModelLoadError("config.json has neither layer_types nor layers_block_type")
    kinds = []
    for kind in raw:
        norm = _MAMBA_KINDS.get(kind) or _ATTN_KINDS.get(kind)
        if norm is None:
            raise ModelLoadError(f"unknown layer type {kind!r}")
        kinds.append(norm)
    if n and len(kinds) != n:
        raise ModelLoadError(f"{len(kinds)} layer types for num_hidden_layers={n}")
    return tuple(kinds)


def arrangement(kinds: tuple[str, ...], shared_size: int, experts: int, expert_size: int,
                residual: float) -> tuple[tuple[Sublayer, ...], ...]:
    """Every layer: `input_layernorm` -> its mixer (`mamba` or `self_attn`), then
    `post_attention_layernorm` -> the fused gated MLP `shared_mlp` (+ the MoE `block_sparse_moe` when
    the model has experts); both residual adds scaled by `residual_multiplier`."""
    ffn = [Block("fused_gated_mlp", "shared_mlp", shared_size, "shared_intermediate_size")]
    if experts:
        ffn.append(Block("softmax_moe", "block_sparse_moe", expert_size, "intermediate_size"))
    out = []
    for kind in kinds:
        mixer = Block("mamba", "mamba") if kind == "mamba" else Block("attention", "self_attn")
        out.append((Sublayer("input_layernorm", (mixer,), residual),
                    Sublayer("post_attention_layernorm", tuple(ffn), residual)))
    return tuple(out)


def parse(cfg: dict, arch: str) -> HybridConfig:
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    check_act(cfg, "hidden_act", "silu")
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    check_attention(heads, kv_heads)
    n_experts = int(cfg.get("num_local_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0) if n_experts else 0
    if n_experts and not 0 < top_k <= n_experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be in [1, num_local_experts={n_experts}]")
    kinds = layer_kinds(cfg)
    shared_size = int(cfg.get("shared_intermediate_size", 1024))
    expert_size = int(cfg.get("intermediate_size", 0))
    residual = num(cfg, "residual_multiplier", 1.0)
    return HybridConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        layer_kinds=kinds,
        rms_norm_eps=num(cfg, "rms_norm_eps", 1e-6),
        max_position_embeddings=max_positions(cfg),
        attn=AttentionConfig(
            num_heads=heads, num_kv_heads=kv_heads, head_dim=int(cfg.get("head_dim") or hidden // heads),
            bias=bool(cfg.get("attention_bias", False)), scale=num(cfg, "attention_multiplier", 1.0),
            rope_theta=rope_theta(cfg, cfg.get("position_embedding_type") == "rope"),
        ),
        mamba=mamba_part(cfg, int(cfg.get("mamba_expand", 2)) * hidden),
        moe=MoeConfig(num_experts=n_experts, experts_per_tok=top_k),
        embedding_multiplier=num(cfg, "embedding_multiplier", 1.0),
        residual_multiplier=residual,
        logits_scaling=num(cfg, "logits_scaling", 1.0),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        layer_specs=arrangement(kinds, shared_size, n_experts, expert_size, residual),
        renames=RENAMES,
    )


FAMILY = Family(parse, layer_kinds)
