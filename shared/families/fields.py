"""Readers of `config.json` fields shared by the family parsers (torch-free): defaults for explicit
nulls, the context length, RoPE and scan-step settings, and the checks that name the offending field."""

from __future__ import annotations

import math


def num(cfg: dict, key: str, default: float) -> float:
    """A float field where an explicit null means the default (transformers writes nulls)."""
    value = cfg.get(key)
    return float(default if value is None else value)


def max_positions(cfg: dict) -> int:
    max_pos = cfg.get("max_position_embeddings") or 4096
    if isinstance(max_pos, float) and math.isinf(max_pos):
        max_pos = 1 << 20
    return int(max_pos)


def time_step_limit(cfg: dict, key: str = "time_step_limit") -> tuple[float, float]:
    tsl = cfg.get(key) or (0.0, math.inf)
    return float(tsl[0]), float(tsl[1])


def rotary_fraction(cfg: dict, default: float = 1.0) -> float:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    value = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    return float(default if value is None else value)


def rope_theta(cfg: dict, enabled: bool) -> float | None:
    """The default-RoPE base when `enabled` (only rope_type 'default' is supported)."""
    if not enabled:
        return None
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"unsupported rope_type {rope_type!r} (only 'default')")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def check_mamba(heads: int, groups: int, d_head: int, inner: int,
                fields: tuple[str, str, str] = ("mamba_n_heads", "mamba_n_groups", "mamba_d_head")) -> None:
    """`fields`: the family's names of the head count, group count and head dim."""
    if d_head * heads != inner:
        raise ValueError(f"{fields[2]} {d_head} * {fields[0]} {heads} != mamba intermediate {inner}")
    if heads % groups:
        raise ValueError(f"{fields[1]} {groups} does not divide {fields[0]} {heads}")


def check_attention(heads: int, kv_heads: int) -> None:
    if heads % kv_heads:
        raise ValueError(f"num_key_value_heads {kv_heads} does not divide num_attention_heads {heads}")


def check_act(cfg: dict, key: str, allowed: str) -> None:
    act = cfg.get(key, allowed)
    if act != allowed:
        raise ValueError(f"unsupported {key} {act!r} (only {allowed!r})")
