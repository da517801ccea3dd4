"""Helpers shared by the family parsers (torch-free): the field defaults a family without
attention (or without Mamba) leaves unset."""

from __future__ import annotations

NO_ATTENTION = dict(
    num_heads=0, num_kv_heads=0, head_dim=0, attention_bias=False, attention_multiplier=1.0, rope_theta=None,
)
NO_GRANITE_MLP = dict(shared_intermediate_size=0, intermediate_size=0)
UNIT_SCALARS = dict(embedding_multiplier=1.0, residual_multiplier=1.0, logits_scaling=1.0)


def dtype_name(cfg: dict) -> str:
    return str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
