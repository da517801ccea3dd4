"""Helpers shared by the family parsers (torch-free): the field defaults a family without
attention (or without Mamba) leaves unset, and the `mamba_*` fields several families share."""

from __future__ import annotations

from shared.families.fields import check_mamba, time_step_limit

NO_ATTENTION = dict(
    num_heads=0, num_kv_heads=0, head_dim=0, attention_bias=False, attention_multiplier=1.0, rope_theta=None,
)
NO_GRANITE_MLP = dict(shared_intermediate_size=0, intermediate_size=0)
UNIT_SCALARS = dict(embedding_multiplier=1.0, residual_multiplier=1.0, logits_scaling=1.0)


def dtype_name(cfg: dict) -> str:
    return str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")


def mamba_fields(cfg: dict, inner: int) -> dict:
    """The Mamba2 fields Granite, Bamba and Falcon-H1 share (`mamba_*`), for an intermediate width `inner`."""
    m_heads = int(cfg.get("mamba_n_heads", 128))
    d_head = cfg.get("mamba_d_head", "auto")
    d_head = inner // m_heads if d_head in (None, "auto") else int(d_head)
    groups = int(cfg.get("mamba_n_groups", 1))
    check_mamba(m_heads, groups, d_head, inner)
    return dict(
        mamba_n_heads=m_heads, mamba_n_groups=groups, mamba_d_state=int(cfg.get("mamba_d_state", 256)),
        mamba_d_head=d_head, mamba_d_conv=int(cfg.get("mamba_d_conv", 4)), mamba_intermediate=inner,
        mamba_chunk_size=int(cfg.get("mamba_chunk_size", 256)),
        mamba_conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        mamba_proj_bias=bool(cfg.get("mamba_proj_bias", False)), time_step_limit=time_step_limit(cfg),
    )
