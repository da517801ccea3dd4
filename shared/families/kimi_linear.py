"""Kimi Linear (Moonshot AI, `KimiLinearForCausalLM`): Kimi Delta Attention interleaved with
Multi-head Latent Attention, a DeepSeek-V3-style MoE.

Every layer: RMSNorm `input_layernorm` -> `self_attn` -> residual, then `post_attention_layernorm` ->
`block_sparse_moe` -> residual. `self_attn` is Kimi Delta Attention on the "linear_attention" layers
(worker_proc.model.kimi_delta; sizes from `linear_attn_config`: `num_heads`, `head_dim`,
`short_conv_kernel_size`) and NoPE MLA on the "full_attention" ones (worker_proc.model.latent_attention;
`q_lora_rank`, `kv_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`,
`num_attention_heads`). The layout is `layer_types`, else `linear_attn_config`'s 1-indexed
`full_attn_layers` / `kda_layers`, else transformers' default (every fourth layer after the first is
full attention). `block_sparse_moe` is a gated SiLU MLP of `intermediate_size` on the first
`first_k_dense_replace` layers (or where `mlp_layer_types` says "dense"), else the grouped
sigmoid-routed MoE (worker_proc.model.grouped_moe: `num_experts` experts of `moe_intermediate_size`,
top `num_experts_per_token` within `topk_group` of `num_expert_group` groups, `moe_renormalize`,
`routed_scaling_factor`, `num_shared_experts` * `moe_intermediate_size` shared width). Config fields
are read under either name transformers maps between (`attribute_map`); the hub's `mla_use_nope` must
not be false and `moe_router_activation_func` must be "sigmoid" (what transformers runs). The head is never tied:
transformers' model keeps `lm_head.weight` its own even under `tie_word_embeddings`. The checkpoint's names map
onto the shared blocks' (`RENAMES`).
"""

from __future__ import annotations

from shared.families.common import dtype_name
from shared.families.family import Family
from shared.families.fields import check_act, num
from shared.model_config import AttentionConfig, Block, HybridConfig, KdaConfig, MlaConfig, MoeConfig, Sublayer

_KINDS = {"linear_attention": "kda", "full_attention": "attention"}
RENAMES = (
    (r"\.block_sparse_moe\.experts\.(\d+)\.w1\.", r".block_sparse_moe.experts.\1.gate_proj."),
    (r"\.block_sparse_moe\.experts\.(\d+)\.w3\.", r".block_sparse_moe.experts.\1.up_proj."),
    (r"\.block_sparse_moe\.experts\.(\d+)\.w2\.", r".block_sparse_moe.experts.\1.down_proj."),
    (r"\.block_sparse_moe\.shared_experts\.", ".block_sparse_moe.shared_expert."),
)
"""Kimi Linear checkpoint names -> the shared blocks' parameter names."""


def _field(cfg: dict, *names: str, default: object = None) -> object:
    """The first of `names` present and not null (a field and the name transformers maps it to)."""
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    return default


def layer_kinds(cfg: dict) -> tuple[str, ...]:
    n = int(cfg["num_hidden_layers"])
    raw = cfg.get("layer_types")
    linear = cfg.get("linear_attn_config") or {}
    if raw is None and "full_attn_layers" in linear and "kda_layers" in linear:
        raw = [None] * n
        for i in linear["full_attn_layers"]:
            raw[int(i) - 1] = "full_attention"
        for i in linear["kda_layers"]:
            raw[int(i) - 1] = "linear_attention"
    if raw is None:
        raw = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    bad = [t for t in raw if t not in _KINDS]
    if bad:
        raise ValueError(f"unknown layer type {bad[0]!r} (one of {', '.join(_KINDS)})")
    if len(raw) != n:
        raise ValueError(f"{len(raw)} layer types for num_hidden_layers={n}")
    return tuple(_KINDS[t] for t in raw)


def _mla_parts(cfg: dict) -> tuple[AttentionConfig, MlaConfig]:
    if cfg.get("mla_use_nope") is False:
        raise ValueError("mla_use_nope false (RoPE on the MLA layers' shared key channels) is not supported")
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(_field(cfg, "num_key_value_heads", default=heads))  # type: ignore[arg-type]
    if kv_heads != heads:
        raise ValueError(f"num_key_value_heads {kv_heads} != num_attention_heads {heads}: MLA expands the latent "
                         "into every head")
    mla = MlaConfig(q_lora_rank=int(_field(cfg, "q_lora_rank", default=0)),  # type: ignore[arg-type]
                    kv_lora_rank=int(cfg.get("kv_lora_rank", 512)), nope_dim=int(cfg.get("qk_nope_head_dim", 128)),
                    rope_dim=int(cfg.get("qk_rope_head_dim", 64)), v_dim=int(cfg.get("v_head_dim") or 128))
    # the KV pool caches the latent: one KV head of [normed latent | shared key] (worker_proc.model.latent_attention)
    attn = AttentionConfig(num_heads=heads, num_kv_heads=1, head_dim=mla.kv_lora_rank + mla.rope_dim,
                           bias=bool(cfg.get("attention_bias", False)), scale=mla.qk_dim**-0.5, rope_theta=None)
    return attn, mla


def _kda_part(cfg: dict) -> KdaConfig:
    linear = cfg.get("linear_attn_config") or {}
    part = KdaConfig(heads=int(linear.get("num_heads", cfg.get("linear_num_heads", 32))),
                     head_dim=int(linear.get("head_dim", cfg.get("linear_head_dim", 128))),
                     d_conv=int(linear.get("short_conv_kernel_size", cfg.get("linear_conv_kernel_dim", 4))))
    if part.d_conv < 2:
        raise ValueError(f"short_conv_kernel_size {part.d_conv} must be at least 2")
    return part


def _mlp_blocks(cfg: dict, n: int) -> tuple[tuple[Block, ...], MoeConfig]:
    """The `block_sparse_moe` block of every layer and the MoE part."""
    types = cfg.get("mlp_layer_types")
    if types is None:
        first = int(cfg.get("first_k_dense_replace", 1))
        types = ["dense" if i < first else "sparse" for i in range(n)]
    if len(types) != n or any(t not in ("dense", "sparse") for t in types):
        raise ValueError(f"mlp_layer_types {types} must give 'dense' or 'sparse' for each of {n} layers")
    dense = Block("gated_mlp", "block_sparse_moe", int(cfg["intermediate_size"]), "intermediate_size")
    if "sparse" not in types:
        return (dense,) * n, MoeConfig()
    experts = int(_field(cfg, "num_experts", "num_local_experts", default=256))  # type: ignore[arg-type]
    top_k = int(_field(cfg, "num_experts_per_token", "num_experts_per_tok", default=8))  # type: ignore[arg-type]
    if not 0 < top_k <= experts:
        raise ValueError(f"num_experts_per_token {top_k} must be in [1, num_experts={experts}]")
    inner = int(cfg.get("moe_intermediate_size", 1024))
    moe = MoeConfig(
        num_experts=experts, experts_per_tok=top_k,
        n_group=int(_field(cfg, "num_expert_group", "n_group", default=1)),  # type: ignore[arg-type]
        topk_group=int(_field(cfg, "topk_group", default=1)),  # type: ignore[arg-type]
        norm_topk_prob=bool(_field(cfg, "moe_renormalize", "norm_topk_prob", default=True)),
        routed_scaling=num(cfg, "routed_scaling_factor", 2.446),
        shared_size=inner * int(_field(cfg, "num_shared_experts", "n_shared_experts", default=1)),  # type: ignore[arg-type]
    )
    sparse = Block("grouped_swiglu_moe", "block_sparse_moe", inner, "moe_intermediate_size")
    return tuple(dense if t == "dense" else sparse for t in types), moe


def parse(cfg: dict, arch: str) -> HybridConfig:
    kinds = layer_kinds(cfg)
    check_act(cfg, "hidden_act", "silu")
    check_act(cfg, "moe_router_activation_func", "sigmoid")
    mlps, moe = _mlp_blocks(cfg, len(kinds))
    mixers = {"kda": Block("kda", "self_attn"), "attention": Block("mla", "self_attn")}
    specs = tuple((Sublayer("input_layernorm", (mixers[k],)), Sublayer("post_attention_layernorm", (mlp,)))
                  for k, mlp in zip(kinds, mlps, strict=True))
    attn, mla = _mla_parts(cfg)
    return HybridConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        layer_kinds=kinds,
        rms_norm_eps=num(cfg, "rms_norm_eps", 1e-5),
        max_position_embeddings=context(cfg),
        tie_word_embeddings=False,  # transformers' KimiLinearForCausalLM keeps lm_head its own whatever the config says
        torch_dtype=dtype_name(cfg),
        layer_specs=specs,
        attn=attn,
        mla=mla,
        kda=_kda_part(cfg),
        moe=moe,
        renames=RENAMES,
    )


def context(cfg: dict) -> int:
    """`model_max_length` (transformers' name for max_position_embeddings here), else the latter."""
    return int(_field(cfg, "model_max_length", "max_position_embeddings", default=1 << 20))  # type: ignore[arg-type]


FAMILY = Family(parse, layer_kinds, context)
