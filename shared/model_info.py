"""What the non-worker processes need to know about a checkpoint, read from `config.json`.

The worker parses the full config itself (worker_proc); this is the torch-free subset the
scheduler and tokenizer use: layer kinds, EOS ids, context length, vocabulary size.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from shared.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("GraniteMoeHybridForCausalLM",)
_MAMBA_KINDS = {"mamba": "mamba", "linear_attention": "mamba", "mamba2": "mamba"}
_ATTN_KINDS = {"attention": "attention", "full_attention": "attention"}


def _float_hook(obj: dict) -> object:
    # transformers writes float("inf") as {"__float__": "Infinity"} in time_step_limit
    if set(obj) == {"__float__"}:
        return float(obj["__float__"])
    return obj


def read_config_json(model_dir: str) -> dict:
    """Parse `model_dir/config.json`, decoding the `{"__float__": "Infinity"}` encoding."""
    if not os.path.isdir(model_dir):
        raise ModelLoadError(f"model path {model_dir!r} is not a directory")
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ModelLoadError(f"missing {path}")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        return json.loads(text, object_hook=_float_hook)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e


def layer_kinds(cfg: dict) -> list[str]:
    """Normalised per-layer mixer kinds: "mamba" or "attention"."""
    raw = cfg.get("layer_types") or cfg.get("layers_block_type")
    n = int(cfg.get("num_hidden_layers", 0))
    if raw is None:
        raise ModelLoadError("config.json has neither layer_types nor layers_block_type")
    kinds = []
    for kind in raw:
        norm = _MAMBA_KINDS.get(kind) or _ATTN_KINDS.get(kind)
        if norm is None:
            raise ModelLoadError(f"config.json: unknown layer type {kind!r}")
        kinds.append(norm)
    if n and len(kinds) != n:
        raise ModelLoadError(f"config.json: {len(kinds)} layer types for num_hidden_layers={n}")
    return kinds


@dataclass(frozen=True)
class ModelInfo:
    architecture: str
    layer_kinds: tuple[str, ...]
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_position_embeddings: int

    @property
    def has_mamba(self) -> bool:
        return "mamba" in self.layer_kinds

    @property
    def has_attention(self) -> bool:
        return "attention" in self.layer_kinds

    @staticmethod
    def from_dir(model_dir: str) -> ModelInfo:
        cfg = read_config_json(model_dir)
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else ""
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {arch!r} in {model_dir}/config.json "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        max_pos = cfg.get("max_position_embeddings") or 4096
        if isinstance(max_pos, float) and math.isinf(max_pos):
            max_pos = 1 << 20
        return ModelInfo(
            architecture=arch,
            layer_kinds=tuple(layer_kinds(cfg)),
            vocab_size=int(cfg["vocab_size"]),
            eos_token_ids=eos_ids,
            max_position_embeddings=int(max_pos),
        )
