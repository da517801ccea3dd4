"""Qwen3-Next and Qwen3.5 (dense and MoE): Gated DeltaNet hybrids.

Architectures: `Qwen3NextForCausalLM`, `Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`, and the
multimodal wrappers the Qwen3.5 checkpoints ship as (`Qwen3_5ForConditionalGeneration`,
`Qwen3_5MoeForConditionalGeneration`): the text model (`text_config`, tensors
`model.language_model.*` mapped onto `model.*`) and, where `vision_config` has blocks, the vision
tower (`HybridConfig.vision`, tensors `model.visual.*` mapped onto `visual.*`, worker_proc.model.vision)
with the text model's multimodal RoPE (`rope_parameters.mrope_section`, interleaved: the only layout
read; `AttentionConfig.mrope_section`). A wrapper without a tower skips `model.visual.*` (logged by the
loader). Images are served; video inputs are not.

Every layer: zero-centred RMSNorm (x̂ * (1 + w)) `input_layernorm` -> mixer -> residual, then
`post_attention_layernorm` -> `mlp` -> residual. The mixer (`layer_types`: "linear_attention" or
"full_attention"; else every `full_attention_interval`-th layer is attention) is a Gated DeltaNet
(`linear_attn`, worker_proc.model.gated_deltanet; Qwen3-Next's fused in_proj_qkvz / in_proj_ba or
Qwen3.5's split projections) or gated attention (`self_attn`: output gate, zero-centred q/k
RMSNorm, RoPE on the first `partial_rotary_factor` of each head, scale 1/sqrt(head_dim)). The `mlp`
is the sparse MoE with a sigmoid-gated shared expert (worker_proc.model.qwen_moe) where
num_experts > 0, the layer is not in `mlp_only_layers` and (layer + 1) % decoder_sparse_step == 0
(Qwen3.5-MoE: every layer, normalised top-k), else a split gated SiLU MLP (`intermediate_size`).
The final norm is zero-centred too.
MTP (`mtp_num_hidden_layers` or `num_nextn_predict_layers` > 0; built only for
`--speculative-algorithm NEXTN`, worker_proc.model.mtp): `mtp.layers.N` are full-attention layers
with the MLP of layer 0, after `mtp.fc` over the zero-centred-normed embedding and hidden state.
"""

from __future__ import annotations

from shared.families.common import dtype_name
from shared.families.family import Family
from shared.families.fields import check_act, check_attention, max_positions, num, rope_theta, rotary_fraction
from shared.model_config import AttentionConfig, Block, GdnConfig, HybridConfig, MoeConfig, Sublayer, VisionConfig

WRAPPERS = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
MOE_EVERY_LAYER = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
FUSED_PROJ = ("Qwen3NextForCausalLM",)
_KINDS = {"linear_attention": "gdn", "full_attention": "attention"}
_VISION_INTS = {  # vision_config's integer fields and the values transformers gives those a config omits
    "depth": 27, "hidden_size": 1152, "num_heads": 16, "intermediate_size": 4304, "in_channels": 3, "patch_size": 16,
    "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 3584, "num_position_embeddings": 2304,
}


def text_config(cfg: dict) -> dict:
    """The text model's fields: `text_config` of a multimodal wrapper (with the wrapper's fields it
    lacks), else the config itself."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        return cfg
    return {**{k: v for k, v in cfg.items() if k != "text_config"}, **text}


def layer_kinds(cfg: dict) -> tuple[str, ...]:
    cfg = text_config(cfg)
    n = int(cfg["num_hidden_layers"])
    raw = cfg.get("layer_types")
    if raw is None:
        interval = int(cfg.get("full_attention_interval") or 4)
        raw = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    bad = [t for t in raw if t not in _KINDS]
    if bad:
        raise ValueError(f"unknown layer_types entry {bad[0]!r} (one of {', '.join(_KINDS)})")
    if len(raw) != n:
        raise ValueError(f"{len(raw)} layer_types for num_hidden_layers={n}")
    return tuple(_KINDS[t] for t in raw)


def context(cfg: dict) -> int:
    return max_positions(text_config(cfg))


def _gdn_part(cfg: dict, arch: str) -> GdnConfig:
    k_heads, v_heads = int(cfg.get("linear_num_key_heads", 16)), int(cfg.get("linear_num_value_heads", 32))
    if k_heads <= 0 or v_heads % k_heads:
        raise ValueError(f"linear_num_key_heads {k_heads} does not divide linear_num_value_heads {v_heads}")
    return GdnConfig(
        k_heads=k_heads, v_heads=v_heads, k_dim=int(cfg.get("linear_key_head_dim", 128)),
        v_dim=int(cfg.get("linear_value_head_dim", 128)), d_conv=int(cfg.get("linear_conv_kernel_dim", 4)),
        fused_proj=arch in FUSED_PROJ,
    )


def _vision_part(raw: dict, arch: str) -> VisionConfig:
    """The wrapper's vision tower (depth 0: none, or not a wrapper)."""
    vis = raw.get("vision_config")
    if arch not in WRAPPERS or not isinstance(vis, dict) or not int(vis.get("depth") or 0):
        return VisionConfig()
    defaults = VisionConfig()
    sizes: dict = {}
    for name, default in _VISION_INTS.items():
        value = vis.get(name, default)
        if isinstance(value, list | tuple) or value is None:
            raise ValueError(f"vision_config.{name} {value!r} must be one integer")
        sizes[name] = int(value)
    rope = vis.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"unsupported vision_config.rope_parameters.rope_type {rope.get('rope_type')!r} "
                         "(only 'axial')")
    return VisionConfig(**sizes, hidden_act=str(vis.get("hidden_act", defaults.hidden_act)),
                        image_token_id=int(raw.get("image_token_id", -1)),
                        rope_theta=float(rope.get("rope_theta", defaults.rope_theta)))


def _mrope_section(cfg: dict) -> tuple[int, ...]:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    section = params.get("mrope_section")
    if not section:
        raise ValueError("a Qwen3.5 model with a vision tower needs rope_parameters.mrope_section")
    if not params.get("mrope_interleaved", True):
        raise ValueError("rope_parameters.mrope_interleaved false is not supported (only the interleaved layout)")
    return tuple(int(s) for s in section)


def _attention_part(cfg: dict, mrope: bool = False) -> AttentionConfig:
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    check_attention(heads, kv_heads)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    rotary = int(head_dim * rotary_fraction(cfg, 0.25))
    if rotary % 2 or not 0 < rotary <= head_dim:
        raise ValueError(f"partial_rotary_factor gives {rotary} rotary channels of head_dim {head_dim}")
    return AttentionConfig(
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, bias=bool(cfg.get("attention_bias")),
        scale=head_dim**-0.5, rope_theta=rope_theta(cfg, True), rotary_dim=rotary, output_gate=True, qk_norm=True,
        mrope_section=_mrope_section(cfg) if mrope else (),
    )


def _mlp_blocks(cfg: dict, arch: str, n: int) -> tuple[tuple[Block, ...], MoeConfig]:
    """The `mlp` block of every layer and the MoE part."""
    experts = int(cfg.get("num_experts") or 0)
    dense = Block("gated_mlp", "mlp", int(cfg.get("intermediate_size") or 0), "intermediate_size")
    if not experts:
        return (dense,) * n, MoeConfig()
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if not 0 < top_k <= experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be in [1, num_experts={experts}]")
    moe = Block("shared_gate_moe", "mlp", int(cfg["moe_intermediate_size"]), "moe_intermediate_size")
    if arch in MOE_EVERY_LAYER:
        only, step, norm_topk = set(), 1, True
    else:
        only = {int(i) for i in cfg.get("mlp_only_layers") or ()}
        step, norm_topk = int(cfg.get("decoder_sparse_step") or 1), bool(cfg.get("norm_topk_prob", True))
    blocks = tuple(moe if i not in only and (i + 1) % step == 0 else dense for i in range(n))
    part = MoeConfig(num_experts=experts, experts_per_tok=top_k, norm_topk_prob=norm_topk,
                     shared_size=int(cfg.get("shared_expert_intermediate_size") or 0))
    return blocks, part


def parse(raw: dict, arch: str) -> HybridConfig:
    cfg = text_config(raw)
    check_act(cfg, "hidden_act", "silu")
    kinds = layer_kinds(cfg)
    mlps, moe = _mlp_blocks(cfg, arch, len(kinds))
    mixers = {"gdn": Block("gdn", "linear_attn"), "attention": Block("attention", "self_attn")}
    specs = tuple(
        (Sublayer("input_layernorm", (mixers[k],)), Sublayer("post_attention_layernorm", (mlp,)))
        for k, mlp in zip(kinds, mlps, strict=True)
    )
    wrapper = arch in WRAPPERS
    vision = _vision_part(raw, arch)
    mtp = int(cfg.get("mtp_num_hidden_layers") or cfg.get("num_nextn_predict_layers") or 0)
    return HybridConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        layer_kinds=kinds,
        rms_norm_eps=num(cfg, "rms_norm_eps", 1e-6),
        max_position_embeddings=max_positions(cfg),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
        torch_dtype=dtype_name(cfg),
        layer_specs=specs,
        attn=_attention_part(cfg, mrope=bool(vision.depth)),
        gdn=_gdn_part(cfg, arch),
        moe=moe,
        vision=vision,
        norm_unit_offset=True,
        renames=((r"^model\.language_model\.", "model."), (r"^model\.visual\.", "visual.")) if wrapper else (),
        ignored_prefixes=("mtp.", "visual.") if wrapper and not vision.depth else ("mtp.",),
        mtp_layers=mtp,
        mtp_spec=(Sublayer("input_layernorm", (mixers["attention"],)),
                  Sublayer("post_attention_layernorm", (mlps[0],))) if mtp else (),
    )


FAMILY = Family(parse, layer_kinds, context=context, text_config=text_config)
