"""Helpers shared by the family parsers (torch-free): the checkpoint dtype and the Mamba part
several families read from the same `mamba_*` fields."""

from __future__ import annotations

from shared.families.fields import check_mamba, time_step_limit
from shared.model_config import MambaConfig


def dtype_name(cfg: dict) -> str:
    return str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")


def mamba_part(cfg: dict, inner: int, **extra: object) -> MambaConfig:
    """The Mamba2 part Granite, Bamba and Falcon-H1 read from the same `mamba_*` fields, for an
    intermediate width `inner`; `extra`: the family's own Mamba settings."""
    m_heads = int(cfg.get("mamba_n_heads", 128))
    d_head = cfg.get("mamba_d_head", "auto")
    d_head = inner // m_heads if d_head in (None, "auto") else int(d_head)
    groups = int(cfg.get("mamba_n_groups", 1))
    check_mamba(m_heads, groups, d_head, inner)
    return MambaConfig(
        n_heads=m_heads, n_groups=groups, d_state=int(cfg.get("mamba_d_state", 256)), d_head=d_head,
        d_conv=int(cfg.get("mamba_d_conv", 4)), intermediate=inner, chunk_size=int(cfg.get("mamba_chunk_size", 256)),
        conv_bias=bool(cfg.get("mamba_conv_bias", True)), proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        time_step_limit=time_step_limit(cfg), **extra,  # type: ignore[arg-type]
    )
