"""`HybridConfig`: the frozen, validated subset of a GraniteMoeHybrid `config.json` the model uses.

Parsed once by the loader; every module reads its sizes from here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shared.errors import ModelLoadError
from shared.model_info import SUPPORTED_ARCHITECTURES, layer_kinds


@dataclass(frozen=True)
class HybridConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    layer_kinds: tuple[str, ...]  # "mamba" | "attention" per layer
    rms_norm_eps: float
    # attention
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention_bias: bool
    attention_multiplier: float
    rope_theta: float | None  # None = NoPE
    max_position_embeddings: int
    # mamba
    mamba_n_heads: int
    mamba_n_groups: int
    mamba_d_state: int
    mamba_d_head: int
    mamba_d_conv: int
    mamba_intermediate: int
    mamba_chunk_size: int
    mamba_conv_bias: bool
    mamba_proj_bias: bool
    time_step_limit: tuple[float, float]
    # mlp
    shared_intermediate_size: int
    intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    # scalars
    embedding_multiplier: float
    residual_multiplier: float
    logits_scaling: float
    tie_word_embeddings: bool
    torch_dtype: str

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def conv_dim(self) -> int:
        return self.mamba_intermediate + 2 * self.mamba_n_groups * self.mamba_d_state

    @property
    def attn_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == "attention")

    @property
    def mamba_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == "mamba")

    @staticmethod
    def from_dict(cfg: dict, source: str = "config.json") -> HybridConfig:
        """Validate and normalise a parsed config.json; raises ModelLoadError naming `source`."""
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else ""
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {arch!r} in {source} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        try:
            return _build(cfg, arch)
        except KeyError as e:
            raise ModelLoadError(f"{source}: missing required field {e.args[0]!r}") from e
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"{source}: {e}") from e


def tp_layout_error(cfg: HybridConfig, tp_size: int) -> str | None:
    """Why `cfg` cannot be split over `tp_size` ranks (one line naming the config field), or None.
    KV heads fewer than the ranks are replicated, so they must then divide `tp_size`."""
    if tp_size == 1:
        return None
    counts: list[tuple[int, str]] = []
    if cfg.attn_layer_ids:
        counts.append((cfg.num_heads, "num_attention_heads"))
        if cfg.num_kv_heads >= tp_size:
            counts.append((cfg.num_kv_heads, "num_key_value_heads"))
    if cfg.mamba_layer_ids:
        counts.append((cfg.mamba_n_heads, "mamba_n_heads"))
    counts.append((cfg.shared_intermediate_size, "shared_intermediate_size"))
    if cfg.num_experts:
        counts.append((cfg.intermediate_size, "intermediate_size"))
    for value, field in counts:
        if value % tp_size:
            return f"--tp-size {tp_size} does not divide {field} {value} of the model's config.json"
    if cfg.attn_layer_ids and cfg.num_kv_heads < tp_size and tp_size % cfg.num_kv_heads:
        return (f"--tp-size {tp_size} is not a multiple of num_key_value_heads {cfg.num_kv_heads} "
                "(KV heads fewer than the ranks are replicated and must divide --tp-size)")
    return None


def _rope_theta(cfg: dict) -> float | None:
    if cfg.get("position_embedding_type") != "rope":
        return None
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"unsupported rope_type {rope_type!r} (only 'default')")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def _num(cfg: dict, key: str, default: float) -> float:
    """A float field where an explicit null means the default (transformers writes nulls)."""
    value = cfg.get(key)
    return float(default if value is None else value)


def _build(cfg: dict, arch: str) -> HybridConfig:
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r} (only 'silu')")
    m_heads = int(cfg.get("mamba_n_heads", 128))
    m_inter = int(cfg.get("mamba_expand", 2)) * hidden
    d_head = cfg.get("mamba_d_head", "auto")
    d_head = m_inter // m_heads if d_head in (None, "auto") else int(d_head)
    if d_head * m_heads != m_inter:
        raise ValueError(f"mamba_d_head {d_head} * mamba_n_heads {m_heads} != mamba intermediate {m_inter}")
    groups = int(cfg.get("mamba_n_groups", 1))
    if m_heads % groups:
        raise ValueError(f"mamba_n_groups {groups} does not divide mamba_n_heads {m_heads}")
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise ValueError(f"num_key_value_heads {kv_heads} does not divide num_attention_heads {heads}")
    tsl = cfg.get("time_step_limit") or (0.0, math.inf)
    max_pos = cfg.get("max_position_embeddings") or 4096
    if isinstance(max_pos, float) and math.isinf(max_pos):
        max_pos = 1 << 20
    n_experts = int(cfg.get("num_local_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0) if n_experts else 0
    if n_experts and not 0 < top_k <= n_experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be in [1, num_local_experts={n_experts}]")
    return HybridConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        layer_kinds=tuple(layer_kinds(cfg)),
        rms_norm_eps=_num(cfg, "rms_norm_eps", 1e-6),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        attention_bias=bool(cfg.get("attention_bias", False)),
        attention_multiplier=_num(cfg, "attention_multiplier", 1.0),
        rope_theta=_rope_theta(cfg),
        max_position_embeddings=int(max_pos),
        mamba_n_heads=m_heads,
        mamba_n_groups=groups,
        mamba_d_state=int(cfg.get("mamba_d_state", 256)),
        mamba_d_head=d_head,
        mamba_d_conv=int(cfg.get("mamba_d_conv", 4)),
        mamba_intermediate=m_inter,
        mamba_chunk_size=int(cfg.get("mamba_chunk_size", 256)),
        mamba_conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        mamba_proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        time_step_limit=(float(tsl[0]), float(tsl[1])),
        shared_intermediate_size=int(cfg.get("shared_intermediate_size", 1024)),
        intermediate_size=int(cfg.get("intermediate_size", 0)),
        num_experts=n_experts,
        num_experts_per_tok=top_k,
        embedding_multiplier=_num(cfg, "embedding_multiplier", 1.0),
        residual_multiplier=_num(cfg, "residual_multiplier", 1.0),
        logits_scaling=_num(cfg, "logits_scaling", 1.0),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
    )
