"""NemotronHForCausalLM (Nemotron-H 8B/47B/56B, NVIDIA-Nemotron-Nano-9B/12B-v2, Nemotron-3-Nano
MoE): every layer is one pre-normed block (`norm`, `mixer`) with a residual add: a Mamba2 mixer, a
RoPE-free attention (scale 1/sqrt(head_dim), explicit `head_dim`), a relu2 MLP or the sigmoid-routed
MoE (worker_proc.model.moe). The pattern comes from `hybrid_override_pattern` (M = Mamba, * =
attention, - = MLP, E = MoE) or `layers_block_type`. Checkpoint names `backbone.embeddings`,
`backbone.norm_f` map onto the shared names.
The Mamba dt is clamped below at `time_step_min` (as the reference's chunked scan does).

MTP (`num_nextn_predict_layers` > 0; built only for `--speculative-algorithm NEXTN`, skipped and
logged otherwise): one MTP step is `len(mtp_layers_block_type)` checkpoint layers `mtp.layers.i`
(one attention, MoE or MLP ones), each pre-normed with a residual add like the model's; the first also
holds `enorm`, `hnorm` and `eh_proj` (the projection of the normed embedding and hidden state), the
last `final_layernorm`. They load as one MTP layer of the shared MTP head, sublayer i named
`norm_i`/`mixer_i`. A checkpoint with several MTP steps drafts with the first (every guess runs it)."""

from __future__ import annotations

import dataclasses

from shared.families.common import dtype_name
from shared.families.family import Family
from shared.families.fields import check_act, check_attention, check_mamba, max_positions, num
from shared.model_config import AttentionConfig, Block, HybridConfig, MambaConfig, MoeConfig, Sublayer

_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_TYPES = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention", "full_attention": "attention",
          "mlp": "mlp", "moe": "moe"}
RENAMES = (
    (r"^backbone\.", "model."),
    (r"^model\.embeddings\.", "model.embed_tokens."),
    (r"^model\.norm_f\.", "model.norm."),
)
# the first MTP step's own tensors onto the shared MTP head's names
_MTP_HEAD_RENAMES = (
    (r"^mtp\.layers\.0\.enorm\.", "mtp.pre_fc_norm_embedding."),
    (r"^mtp\.layers\.0\.hnorm\.", "mtp.pre_fc_norm_hidden."),
    (r"^mtp\.layers\.0\.eh_proj\.", "mtp.fc."),
)
_UNUSED_MTP = "mtp_unused."  # MTP steps after the first: never loaded


def block_types(cfg: dict) -> list[str]:
    """mamba | attention | mlp | moe per layer."""
    pattern = cfg.get("hybrid_override_pattern")
    raw = cfg.get("layers_block_type") or cfg.get("layer_types")
    if raw:
        bad = [t for t in raw if t not in _TYPES]
        if bad:
            raise ValueError(f"unknown layers_block_type {bad[0]!r} (one of {', '.join(_TYPES)})")
        return [_TYPES[t] for t in raw]
    if not pattern:
        raise ValueError("config.json has neither hybrid_override_pattern nor layers_block_type")
    bad = [c for c in pattern if c not in _PATTERN]
    if bad:
        raise ValueError(f"unknown hybrid_override_pattern character {bad[0]!r} (one of M * - E)")
    return [_PATTERN[c] for c in pattern]


_KINDS = {"mamba": "mamba", "attention": "attention", "mlp": "mlp", "moe": "mlp"}


def layer_kinds(cfg: dict) -> tuple[str, ...]:
    return tuple(_KINDS[t] for t in block_types(cfg))


def mtp_block_types(cfg: dict) -> list[str]:
    """attention | mlp | moe per checkpoint layer of one MTP step (one attention: the MTP KV's layer)."""
    raw = cfg.get("mtp_layers_block_type")
    pattern = cfg.get("mtp_hybrid_override_pattern")
    if raw:
        bad = [t for t in raw if _TYPES.get(t) not in ("attention", "mlp", "moe")]
        if bad:
            raise ValueError(f"mtp_layers_block_type {bad[0]!r} is not attention, mlp or moe")
        types = [_TYPES[t] for t in raw]
    elif pattern:
        bad = [c for c in pattern if c not in "*-E"]
        if bad:
            raise ValueError(f"unknown mtp_hybrid_override_pattern character {bad[0]!r} (one of * - E)")
        types = [_PATTERN[c] for c in pattern]
    else:
        types = ["attention", "moe"]
    if types.count("attention") != 1:
        raise ValueError(f"an MTP step of {types} must hold exactly one attention layer")
    return types


def _mtp(cfg: dict, blocks: dict[str, Block]) -> tuple[tuple[Sublayer, ...], tuple[tuple[str, str], ...]]:
    """The MTP head's sublayers and the renames onto them; none when the checkpoint has no MTP."""
    steps = int(cfg.get("num_nextn_predict_layers") or 0)
    if steps <= 0:
        return (), ()
    types = mtp_block_types(cfg)
    spec = tuple(Sublayer(f"norm_{i}", (dataclasses.replace(blocks[t], name=f"mixer_{i}"),))
                 for i, t in enumerate(types))  # fmt: skip
    size, last = len(types), len(types) - 1
    renames = (
        *((rf"^mtp\.layers\.{i}\.", f"{_UNUSED_MTP}{i}.") for i in range(size, steps * size)),
        *_MTP_HEAD_RENAMES,
        (rf"^mtp\.layers\.{last}\.final_layernorm\.", "mtp.norm."),
        (r"^mtp\.layers\.(\d+)\.(norm|mixer)\.", r"mtp.layers.0.\2_\1."),
    )
    return spec, renames


def parse(cfg: dict, arch: str) -> HybridConfig:
    hidden = int(cfg["hidden_size"])
    types = block_types(cfg)
    check_act(cfg, "mlp_hidden_act", "relu2")
    check_act(cfg, "mamba_hidden_act", "silu")
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias true is not supported")
    heads = int(cfg.get("num_attention_heads") or 1)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    check_attention(heads, kv_heads)
    head_dim = int(cfg.get("head_dim") or cfg.get("attention_head_dim") or hidden // heads)  # older configs
    m_heads, m_head_dim = int(cfg["mamba_num_heads"]), int(cfg["mamba_head_dim"])
    groups = int(cfg.get("n_groups", 8))
    check_mamba(m_heads, groups, m_head_dim, m_heads * m_head_dim, ("mamba_num_heads", "n_groups", "mamba_head_dim"))
    experts = int(cfg.get("n_routed_experts") or 0) if "moe" in types else 0
    top_k = int(cfg.get("num_experts_per_tok") or 0) if experts else 0
    if experts and not 0 < top_k <= experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be in [1, n_routed_experts={experts}]")
    n_group = int(cfg.get("n_group") or 1)
    if experts and (experts % n_group or not 0 < int(cfg.get("topk_group") or 1) <= n_group):
        raise ValueError(f"n_group {n_group} / topk_group must split n_routed_experts {experts}")
    mlp = Block("relu2_mlp", "mixer", int(cfg.get("intermediate_size") or 0), "intermediate_size")
    moe = Block("sigmoid_moe", "mixer", int(cfg.get("moe_intermediate_size") or 0), "moe_intermediate_size")
    blocks = {"mamba": Block("mamba", "mixer"), "attention": Block("attention", "mixer"), "mlp": mlp, "moe": moe}
    mtp_spec, mtp_renames = _mtp(cfg, blocks)
    return HybridConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        layer_kinds=tuple(_KINDS[t] for t in types),
        rms_norm_eps=num(cfg, "layer_norm_epsilon", 1e-5),
        max_position_embeddings=max_positions(cfg),
        attn=AttentionConfig(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, scale=head_dim**-0.5),
        mamba=MambaConfig(
            n_heads=m_heads, n_groups=groups, d_state=int(cfg.get("ssm_state_size", 128)), d_head=m_head_dim,
            d_conv=int(cfg.get("conv_kernel", 4)), intermediate=m_heads * m_head_dim,
            chunk_size=int(cfg.get("chunk_size", 128)), conv_bias=bool(cfg.get("use_conv_bias", True)),
            proj_bias=bool(cfg.get("use_bias", False)),
            time_step_limit=(num(cfg, "time_step_min", 0.001), float("inf")),
        ),
        moe=MoeConfig(
            num_experts=experts, experts_per_tok=top_k, n_group=n_group, topk_group=int(cfg.get("topk_group") or 1),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), routed_scaling=num(cfg, "routed_scaling_factor", 1.0),
            latent_size=int(cfg.get("moe_latent_size") or 0),
            shared_size=int(cfg.get("moe_shared_expert_intermediate_size") or 0) if experts else 0,
        ),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        torch_dtype=dtype_name(cfg),
        layer_specs=tuple((Sublayer("norm", (blocks[t],)),) for t in types),
        norm_fp32_weight=True,
        renames=RENAMES + mtp_renames,
        # the loader logs the tensors it skipped
        ignored_prefixes=("mtp.", _UNUSED_MTP) if any(_UNUSED_MTP in r for _, r in mtp_renames) else ("mtp.",),
        mtp_layers=1 if mtp_spec else 0,
        mtp_spec=mtp_spec,
    )


FAMILY = Family(parse, layer_kinds)
