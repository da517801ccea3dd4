"""`HybridConfig`: the frozen, validated model description every family's `config.json` becomes.

Torch-free (the launcher's start-up checks read it). Made by the model registry
(`shared.families.registry.parse_config`): `config.json`'s `architectures[0]` names a family module
under `shared/families/`, whose parser turns the family's field names into this one shape. Every
module of the model reads its sizes from here.

A model is a stack of layers; a layer is a sequence of `Sublayer`s, each
    h = h + multiplier * sum(block(norm(h)) for block in blocks)
where a `Block` is one of the shared blocks (`BLOCK_KINDS`) with its attribute name (which is also
its checkpoint name) and its muP input/output multipliers. The family decides the arrangement; the
blocks are never copied per family.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MIXER_KINDS = ("mamba", "attention", "gdn", "short_conv", "kda", "mla", "mamba1")
MLP_KINDS = ("fused_gated_mlp", "gated_mlp", "relu2_mlp", "softmax_moe", "sigmoid_moe", "shared_gate_moe",
             "sigmoid_swiglu_moe", "grouped_swiglu_moe")
"""Block kinds that mix channels only (no sequence mixing, no state)."""
BLOCK_KINDS = MIXER_KINDS + MLP_KINDS
RECURRENT_KINDS = ("mamba", "parallel", "gdn", "short_conv", "kda", "mamba1")
"""Layer kinds that carry a recurrent state (one state slot per request holds all of them)."""
STATE_CONTENTS = {"mamba": "conv window + SSM state", "parallel": "conv window + SSM state",
                  "gdn": "conv window + delta-rule state", "short_conv": "conv window",
                  "kda": "conv window + delta-rule state (per-channel decay)",
                  "mamba1": "conv window + per-channel SSM state"}
"""What one state slot holds for a layer of each recurrent kind (reported by /get_model_info)."""


@dataclass(frozen=True)
class Block:
    """One shared block of a sublayer. `size` and `size_field`: its MLP width and the config field
    naming it (MLP and MoE kinds; the tensor-parallel check names the field)."""

    kind: str
    name: str
    size: int = 0
    size_field: str = ""
    in_multiplier: float = 1.0
    out_multiplier: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in BLOCK_KINDS:
            raise ValueError(f"unknown block kind {self.kind!r}")


@dataclass(frozen=True)
class Sublayer:
    norm: str  # attribute name of the pre-norm (RMSNorm over hidden)
    blocks: tuple[Block, ...]
    multiplier: float = 1.0  # on the sum of the blocks' outputs before the residual add


@dataclass(frozen=True)
class AttentionConfig:
    """The attention layers' sizes (all zero for a model without attention)."""

    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    bias: bool = False
    scale: float = 1.0  # the softmax scale
    rope_theta: float | None = None  # None = NoPE
    rotary_dim: int = 0  # channels of each head that RoPE rotates (0 = head_dim)
    key_multiplier: float = 1.0  # on K before it is cached
    # gated attention (Qwen3-Next / Qwen3.5): q_proj yields [query | gate] per head, the output is
    # multiplied by sigmoid(gate) before o_proj; q and k are RMS-normed per head (`q_norm`, `k_norm`)
    output_gate: bool = False
    qk_norm: bool = False
    # multimodal RoPE (Qwen3.5's text model; empty = one position axis): rotary positions are (t, h, w), and
    # frequency i of the rotary half takes axis h where i % 3 == 1 and i < 3 * mrope_section[1], axis w where
    # i % 3 == 2 and i < 3 * mrope_section[2], else axis t (the interleaved layout Qwen3.5 ships)
    mrope_section: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        sec = self.mrope_section
        if sec and (len(sec) != 3 or min(sec) < 0 or max(sec) > self.rope_dim // 2 or self.rope_theta is None):
            raise ValueError(f"mrope_section {list(sec)} must be 3 counts in [0, {self.rope_dim // 2}] (the rotary "
                             "frequencies) of a RoPE model")

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    def rope_axes(self) -> tuple[int, ...]:
        """The position axis (0 t, 1 h, 2 w) of each rotary frequency; () without `mrope_section`."""
        if not self.mrope_section:
            return ()
        _, h, w = self.mrope_section
        return tuple(1 if i % 3 == 1 and i < 3 * h else 2 if i % 3 == 2 and i < 3 * w else 0
                     for i in range(self.rope_dim // 2))


@dataclass(frozen=True)
class MambaConfig:
    """The Mamba2 mixers' sizes (all zero for a model without Mamba layers)."""

    n_heads: int = 0
    n_groups: int = 1
    d_state: int = 0
    d_head: int = 0
    d_conv: int = 4
    intermediate: int = 0
    chunk_size: int = 256
    conv_bias: bool = True
    proj_bias: bool = False
    out_proj_bias: bool | None = None  # None = proj_bias (Falcon-H1: projectors_bias)
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    norm: bool = True  # gated RMSNorm on the scan output (else y * silu(z))
    norm_before_gate: bool = False  # RMSNorm(y) * silu(z) instead of RMSNorm(y * silu(z))
    multipliers: tuple[float, ...] = ()  # z, x, B, C, dt segments of in_proj (empty = all 1)

    @property
    def conv_dim(self) -> int:
        return self.intermediate + 2 * self.n_groups * self.d_state


@dataclass(frozen=True)
class GdnConfig:
    """The Gated DeltaNet mixers' sizes (Qwen3-Next / Qwen3.5 `linear_attn`): key heads, value heads
    (a multiple), their dims, the conv width; `fused_proj`: in_proj_qkvz + in_proj_ba grouped per key
    head (Qwen3-Next), else in_proj_qkv / in_proj_z / in_proj_b / in_proj_a (Qwen3.5)."""

    k_heads: int = 0
    v_heads: int = 0
    k_dim: int = 0
    v_dim: int = 0
    d_conv: int = 4
    fused_proj: bool = False


@dataclass(frozen=True)
class ShortConvConfig:
    """The gated short-convolution mixers' sizes (LFM2 `conv`): a depthwise causal conv of width
    `d_conv` over hidden_size channels; `bias` on in_proj, the conv and out_proj alike."""

    d_conv: int = 0
    bias: bool = False


@dataclass(frozen=True)
class KdaConfig:
    """The Kimi Delta Attention mixers' sizes (Kimi Linear `self_attn` of its linear layers): `heads`
    heads of `head_dim` for q, k and v alike (the state is [heads, head_dim, head_dim]), the width of
    the short convolutions on q, k and v."""

    heads: int = 0
    head_dim: int = 0
    d_conv: int = 4


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head Latent Attention (Kimi Linear's full-attention layers): q straight from `q_proj`
    (`q_lora_rank` 0) or through `q_a_proj` -> RMSNorm -> `q_b_proj`; the KV latent of `kv_lora_rank`
    channels and the `rope_dim` key channels shared by every head come from `kv_a_proj_with_mqa`;
    `kv_b_proj` expands the normed latent into each head's `nope_dim` key and `v_dim` value channels.
    Per head the key is [nope | shared], `nope_dim + rope_dim` channels (`qk_dim`). `AttentionConfig`
    holds the head count, one KV head and the KV pool's head_dim, `kv_lora_rank + rope_dim` (the cached
    latent)."""

    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    nope_dim: int = 0
    rope_dim: int = 0
    v_dim: int = 0

    @property
    def qk_dim(self) -> int:
        return self.nope_dim + self.rope_dim


@dataclass(frozen=True)
class Mamba1Config:
    """The Mamba1 (selective scan) mixers' sizes: `d_inner` channels, each with its own [d_state] SSM
    state and conv window of width `d_conv`; dt from a rank-`dt_rank` projection (`x_proj` -> `dt_proj`).
    `bcdt_norm`: the RMS norm on dt, B and C after `x_proj` ("" none: Mamba; "weightless": FalconMamba;
    "weighted": Jamba's `dt_layernorm` / `b_layernorm` / `c_layernorm`), with epsilon `norm_eps`."""

    d_inner: int = 0
    d_state: int = 0
    d_conv: int = 4
    dt_rank: int = 0
    conv_bias: bool = True
    proj_bias: bool = False
    bcdt_norm: str = ""
    norm_eps: float = 1e-6
    inner_field: str = "intermediate_size"  # the config field `d_inner` comes from (the TP check names it)

    def __post_init__(self) -> None:
        if self.bcdt_norm not in ("", "weightless", "weighted"):
            raise ValueError(f"unknown Mamba1 dt/B/C norm {self.bcdt_norm!r}")


@dataclass(frozen=True)
class MoeConfig:
    """The routed experts (every MoE block of the model shares them); `n_group`, `topk_group`,
    `routed_scaling`, `latent_size` are the sigmoid (Nemotron-H) router's; `shared_size` the width of
    the shared expert (0 = none); `choice_bias`: a learned per-expert bias added to the scores for the
    choice only (LFM2-MoE's `expert_bias`; `routed_scaling` applies to its router too)."""

    num_experts: int = 0
    experts_per_tok: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling: float = 1.0
    latent_size: int = 0  # 0 = experts work on hidden_size
    shared_size: int = 0
    choice_bias: bool = False


@dataclass(frozen=True)
class MlpConfig:
    """The split gated MLP's biases and gate/down multipliers (Falcon-H1; empty = 1, 1)."""

    bias: bool = False
    multipliers: tuple[float, ...] = ()


VISION_ACTS = ("gelu_pytorch_tanh", "gelu", "silu", "quick_gelu")


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower (Qwen3.5's `vision_config`, worker_proc.model.vision; depth 0 = no tower): `depth`
    blocks of `num_heads` heads over `hidden_size`, their MLP of `intermediate_size` with `hidden_act`; a
    patch is `in_channels` x `temporal_patch_size` x `patch_size`^2 values; `spatial_merge_size`^2 patches
    merge into one token of `out_hidden_size` (the text model's hidden size); the learned position table
    has `num_position_embeddings` (a square) entries; `image_token_id` is the placeholder of every token of
    an image in the prompt; `rope_theta` the base of the blocks' 2D rotary embedding."""

    depth: int = 0
    hidden_size: int = 0
    num_heads: int = 0
    intermediate_size: int = 0
    hidden_act: str = "gelu_pytorch_tanh"
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 0
    num_position_embeddings: int = 0
    image_token_id: int = -1
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.depth == 0:
            return
        sizes = ("depth", "hidden_size", "num_heads", "intermediate_size", "in_channels", "patch_size",
                 "temporal_patch_size", "spatial_merge_size", "out_hidden_size", "num_position_embeddings")
        for name in sizes:
            if getattr(self, name) <= 0:
                raise ValueError(f"vision_config.{name} {getattr(self, name)} must be positive")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(f"vision_config.num_heads {self.num_heads} must divide hidden_size {self.hidden_size} "
                             "into heads of a multiple of 4 channels (two rotary axes)")
        side = math.isqrt(self.num_position_embeddings)
        if side * side != self.num_position_embeddings:
            raise ValueError(f"vision_config.num_position_embeddings {self.num_position_embeddings} is not a square")
        if self.hidden_act not in VISION_ACTS:
            raise ValueError(f"unsupported vision_config.hidden_act {self.hidden_act!r} "
                             f"(one of {', '.join(VISION_ACTS)})")
        if self.image_token_id < 0:
            raise ValueError(f"image_token_id {self.image_token_id} must be a token id")

    @property
    def patch_dim(self) -> int:
        """Values of one flattened patch (a row of `pixel_values`)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


@dataclass(frozen=True)
class HybridConfig:
    """The whole model: its scalars, its arrangement (`layer_specs`) and one part per block kind. A
    part the model does not use keeps its defaults; every layer kind present needs its part. `vision`:
    the vision tower whose outputs replace image placeholder tokens (depth 0: none)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    # per layer: "mamba" | "attention" (an "attention" or "mla" block) | "parallel" (both) | "gdn" | "short_conv"
    # | "kda" | "mamba1" | "mlp" (none)
    layer_kinds: tuple[str, ...]
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    torch_dtype: str
    layer_specs: tuple[tuple[Sublayer, ...], ...]  # per layer, its sublayers (the family's arrangement)
    attn: AttentionConfig = AttentionConfig()
    mamba: MambaConfig = MambaConfig()
    gdn: GdnConfig = GdnConfig()
    short_conv: ShortConvConfig = ShortConvConfig()
    kda: KdaConfig = KdaConfig()
    mla: MlaConfig = MlaConfig()
    mamba1: Mamba1Config = Mamba1Config()
    moe: MoeConfig = MoeConfig()
    mlp: MlpConfig = MlpConfig()
    vision: VisionConfig = VisionConfig()
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    lm_head_multiplier: float = 1.0  # on the logits
    norm_fp32_weight: bool = False  # RMSNorm weights applied in float32 (Nemotron-H), else in the model dtype
    norm_unit_offset: bool = False  # zero-centred RMSNorm: x̂ * (1 + weight) (every norm but gated ones)
    # the residual stream carried in float32 in a 16-bit model (Mamba / FalconMamba `residual_in_fp32`): each
    # sublayer's norm reads it rounded to the model dtype, the final norm reads it whole (worker_proc.model.residual)
    residual_fp32: bool = False
    # checkpoint names -> parameter names: (regex, replacement) applied in order; tensors whose
    # (renamed) name starts with one of `ignored_prefixes` are not loaded (e.g. MTP layers)
    renames: tuple[tuple[str, str], ...] = ()
    ignored_prefixes: tuple[str, ...] = field(default=())
    # multi-token prediction layers `mtp.layers.N` (drafting, --speculative-algorithm NEXTN): how many the
    # checkpoint has and the sublayers of each (an attention layer of the model's own arrangement)
    mtp_layers: int = 0
    mtp_spec: tuple[Sublayer, ...] = ()

    def __post_init__(self) -> None:
        if len(self.layer_specs) != len(self.layer_kinds):
            raise ValueError(f"{len(self.layer_specs)} layer specs for {len(self.layer_kinds)} layers")
        needs = {"attention": self.attn.num_heads, "mamba": self.mamba.n_heads, "gdn": self.gdn.k_heads,
                 "short_conv": self.short_conv.d_conv, "kda": self.kda.heads,
                 "mla": self.attn.num_heads * self.mla.kv_lora_rank, "mamba1": self.mamba1.d_inner}
        kinds = {b.kind for b in self.blocks()}
        if {"mla", "attention"} <= kinds:
            raise ValueError("MLA and plain attention layers in one model (they share one KV pool layout)")
        for kind in kinds:
            if not needs.get(kind, 1):
                raise ValueError(f"the model has {kind} layers but its {kind} sizes are unset")
            if kind.endswith("moe") and not self.moe.num_experts:
                raise ValueError(f"the model has {kind} blocks but no experts")
        if self.mtp_layers < 0 or bool(self.mtp_layers) != bool(self.mtp_spec):
            raise ValueError(f"{self.mtp_layers} MTP layers with {len(self.mtp_spec)} sublayers each")
        if any(b.kind not in ("attention", *MLP_KINDS) for sub in self.mtp_spec for b in sub.blocks):
            raise ValueError("an MTP layer holds attention and an MLP or MoE only")
        if self.mtp_spec and sum(b.kind == "attention" for sub in self.mtp_spec for b in sub.blocks) != 1:
            raise ValueError("an MTP layer holds exactly one attention block (it reads one MTP KV layer)")
        if self.vision.depth and self.vision.out_hidden_size != self.hidden_size:
            raise ValueError(f"vision_config.out_hidden_size {self.vision.out_hidden_size} is not the text model's "
                             f"hidden_size {self.hidden_size}")
        if self.vision.depth and not 0 <= self.vision.image_token_id < self.vocab_size:
            raise ValueError(f"image_token_id {self.vision.image_token_id} outside the vocabulary of {self.vocab_size}")

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def kv_value_dim(self) -> int:
        """Channels of V per KV head in the KV pool: `attn.head_dim`, or 0 when the attention layers are
        MLA (each reads its cached latent row, K, as its V too: worker_proc.model.latent_attention)."""
        return 0 if self.mla.kv_lora_rank else self.attn.head_dim

    @property
    def attn_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k in ("attention", "parallel"))

    @property
    def mamba_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k in ("mamba", "parallel"))

    @property
    def gdn_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == "gdn")

    @property
    def short_conv_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == "short_conv")

    @property
    def kda_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == "kda")

    @property
    def mamba1_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == "mamba1")

    @property
    def state_layer_ids(self) -> tuple[int, ...]:
        """Layers with a recurrent state (Mamba2, Gated DeltaNet, short convolutions, Kimi Delta Attention,
        Mamba1)."""
        return tuple(i for i, k in enumerate(self.layer_kinds) if k in RECURRENT_KINDS)

    def layers(self) -> tuple[tuple[Sublayer, ...], ...]:
        """The sublayers of every layer, as the family arranged them."""
        return self.layer_specs

    def blocks(self) -> list[Block]:
        return [b for layer in self.layers() for sub in layer for b in sub.blocks]


def tp_layout_error(cfg: HybridConfig, tp_size: int) -> str | None:
    """Why `cfg` cannot be split over `tp_size` ranks (one line naming the config field), or None.
    KV heads fewer than the ranks are replicated, so they must then divide `tp_size`."""
    if tp_size == 1:
        return None
    counts: list[tuple[int, str]] = []
    if cfg.attn_layer_ids:
        counts.append((cfg.attn.num_heads, "num_attention_heads"))
        if cfg.attn.num_kv_heads >= tp_size:
            counts.append((cfg.attn.num_kv_heads, "num_key_value_heads"))
    if cfg.mamba_layer_ids:
        counts.append((cfg.mamba.n_heads, "mamba_n_heads"))
    if cfg.gdn_layer_ids:
        counts.append((cfg.gdn.k_heads, "linear_num_key_heads"))
    if cfg.short_conv_layer_ids:
        counts.append((cfg.hidden_size, "hidden_size"))
    if cfg.kda_layer_ids:
        counts.append((cfg.kda.heads, "linear_attn_config.num_heads"))
    if cfg.mamba1_layer_ids:
        counts.append((cfg.mamba1.d_inner, cfg.mamba1.inner_field))
    for block in cfg.blocks():
        sizes = [(block.size, block.size_field)] if block.size_field else []
        if block.kind == "sigmoid_moe" and cfg.moe.shared_size:
            sizes.append((cfg.moe.shared_size, "moe_shared_expert_intermediate_size"))
        if block.kind in ("shared_gate_moe", "grouped_swiglu_moe") and cfg.moe.shared_size:
            sizes.append((cfg.moe.shared_size, "shared_expert_intermediate_size"))
        counts.extend(s for s in sizes if s not in counts)
    if cfg.mlp.bias and any(b.kind == "gated_mlp" for b in cfg.blocks()):
        return f"--tp-size {tp_size}: mlp_bias true in the model's config.json is not supported with tensor parallelism"
    for value, name in counts:
        if value % tp_size:
            return f"--tp-size {tp_size} does not divide {name} {value} of the model's config.json"
    if cfg.attn_layer_ids and cfg.attn.num_kv_heads < tp_size and tp_size % cfg.attn.num_kv_heads:
        return (f"--tp-size {tp_size} is not a multiple of num_key_value_heads {cfg.attn.num_kv_heads} "
                "(KV heads fewer than the ranks are replicated and must divide --tp-size)")
    return None
