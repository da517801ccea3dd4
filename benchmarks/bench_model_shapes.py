"""The shapes of real Granite-4.0-H checkpoints, as config.json dicts, and their tensor shapes.

Pure data and arithmetic (no torch), used by make_bench_model.py and its tests. As a script it prints a
shape's parameter count, its config.json and (``--tensors``) every tensor's shape:

    python -m benchmarks.bench_model_shapes --shape granite-4.0-h-350m [--num-layers 4] [--tensors]

Every size that fixes a tensor shape (layers and their kinds, hidden size, heads, Mamba heads/state/
groups/conv, MLP and expert sizes, vocabulary) is the published config.json value of the named
model. Scalars that shape no tensor (multipliers, eps, rope/context settings) follow the published
configs where known; they only scale activations of a random-weight model.

Tensor names follow the Hugging Face GraniteMoeHybrid checkpoint layout (``model.layers.{i}.mamba.*``,
``.self_attn.*``, ``.shared_mlp.*``, ``.block_sparse_moe.*``); the embedding is tied to the LM head.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Iterator, Sequence

ATTN_EVERY_10 = [5, 15, 25, 35]  # granite-4.0-h-1b / -micro / -tiny: 40 layers, attention at these


def _layer_types(n: int, attention_at: list[int]) -> list[str]:
    return ["attention" if i in attention_at else "mamba" for i in range(n)]


_COMMON: dict[str, object] = {
    "architectures": ["GraniteMoeHybridForCausalLM"],
    "model_type": "granitemoehybrid",
    "vocab_size": 100352,
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "position_embedding_type": "nope",
    "rope_theta": 10000,
    "mamba_n_groups": 1,
    "mamba_d_state": 128,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 256,
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
    "rms_norm_eps": 1e-5,
    "embedding_multiplier": 12.0,
    "residual_multiplier": 0.22,
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
    "normalization_function": "rmsnorm",
    "pad_token_id": 100256,
    "bos_token_id": 100257,
    "eos_token_id": 100257,
    "use_cache": True,
}

SHAPES: dict[str, dict[str, object]] = {
    "granite-4.0-h-350m": {
        **_COMMON,
        "hidden_size": 768,
        "num_hidden_layers": 32,
        "layer_types": _layer_types(32, [10, 13, 17, 27]),
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "attention_multiplier": 0.015625,
        "mamba_n_heads": 48,
        "mamba_d_head": 32,
        "intermediate_size": 2048,
        "shared_intermediate_size": 2048,
        "num_local_experts": 0,
        "num_experts_per_tok": 0,
        "residual_multiplier": 0.246,
        "logits_scaling": 3.0,
        "max_position_embeddings": 32768,
    },
    "granite-4.0-h-1b": {
        **_COMMON,
        "hidden_size": 1536,
        "num_hidden_layers": 40,
        "layer_types": _layer_types(40, ATTN_EVERY_10),
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "attention_multiplier": 0.0078125,
        "mamba_n_heads": 48,
        "mamba_d_head": 64,
        "intermediate_size": 4096,
        "shared_intermediate_size": 4096,
        "num_local_experts": 0,
        "num_experts_per_tok": 0,
        "logits_scaling": 6.0,
        "max_position_embeddings": 131072,
    },
    "granite-4.0-h-micro": {
        **_COMMON,
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "layer_types": _layer_types(40, ATTN_EVERY_10),
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "attention_multiplier": 0.015625,
        "mamba_n_heads": 64,
        "mamba_d_head": 64,
        "intermediate_size": 8192,
        "shared_intermediate_size": 8192,
        "num_local_experts": 0,
        "num_experts_per_tok": 0,
        "logits_scaling": 8.0,
        "max_position_embeddings": 131072,
    },
    "granite-4.0-h-tiny": {
        **_COMMON,
        "hidden_size": 1536,
        "num_hidden_layers": 40,
        "layer_types": _layer_types(40, ATTN_EVERY_10),
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "attention_multiplier": 0.0078125,
        "mamba_n_heads": 48,
        "mamba_d_head": 64,
        "intermediate_size": 512,
        "shared_intermediate_size": 1024,
        "num_local_experts": 64,
        "num_experts_per_tok": 6,
        "logits_scaling": 6.0,
        "max_position_embeddings": 131072,
    },
}


def bench_config(shape: str, *, num_layers: int | None = None, dtype: str = "float32") -> dict[str, object]:
    """config.json of `shape` (a key of SHAPES). `num_layers` keeps the first N layers of the real
    interleave, the last one turned into attention when none of the N is (a reduced model for tests
    that still has both mixer kinds when N >= 2). Raises ValueError on an unknown shape or N < 1."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r} (known: {', '.join(SHAPES)})")
    cfg = copy.deepcopy(SHAPES[shape])
    if num_layers is not None:
        full = list(cfg["layer_types"])  # type: ignore[call-overload]
        if not 1 <= num_layers <= len(full):
            raise ValueError(f"--num-layers must be in [1, {len(full)}] for {shape}, got {num_layers}")
        kinds = full[:num_layers]
        if "attention" not in kinds and num_layers >= 2:
            kinds[-1] = "attention"
        cfg["layer_types"] = kinds
        cfg["num_hidden_layers"] = num_layers
    cfg["torch_dtype"] = dtype
    return cfg


def tensor_shapes(cfg: dict[str, object]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(checkpoint tensor name, shape) of every tensor of a GraniteMoeHybrid config, in file order."""
    g = lambda k: int(cfg[k])  # noqa: E731
    hidden, vocab = g("hidden_size"), g("vocab_size")
    heads, kv_heads = g("num_attention_heads"), g("num_key_value_heads")
    head_dim = hidden // heads
    m_heads, d_head, state, groups = g("mamba_n_heads"), g("mamba_d_head"), g("mamba_d_state"), g("mamba_n_groups")
    inner = m_heads * d_head
    conv_dim = inner + 2 * groups * state
    shared, experts, expert_inter = g("shared_intermediate_size"), g("num_local_experts"), g("intermediate_size")
    yield "model.embed_tokens.weight", (vocab, hidden)
    for i, kind in enumerate(cfg["layer_types"]):  # type: ignore[attr-defined]
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (hidden,)
        yield p + "post_attention_layernorm.weight", (hidden,)
        if kind == "mamba":
            yield p + "mamba.A_log", (m_heads,)
            yield p + "mamba.D", (m_heads,)
            yield p + "mamba.dt_bias", (m_heads,)
            yield p + "mamba.in_proj.weight", (inner + conv_dim + m_heads, hidden)
            yield p + "mamba.conv1d.weight", (conv_dim, 1, g("mamba_d_conv"))
            if cfg.get("mamba_conv_bias", True):
                yield p + "mamba.conv1d.bias", (conv_dim,)
            yield p + "mamba.norm.weight", (inner,)
            yield p + "mamba.out_proj.weight", (hidden, inner)
        else:
            yield p + "self_attn.q_proj.weight", (heads * head_dim, hidden)
            yield p + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden)
            yield p + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden)
            yield p + "self_attn.o_proj.weight", (hidden, heads * head_dim)
        yield p + "shared_mlp.input_linear.weight", (2 * shared, hidden)
        yield p + "shared_mlp.output_linear.weight", (hidden, shared)
        if experts:
            yield p + "block_sparse_moe.router.layer.weight", (experts, hidden)
            yield p + "block_sparse_moe.input_linear.weight", (experts, 2 * expert_inter, hidden)
            yield p + "block_sparse_moe.output_linear.weight", (experts, hidden, expert_inter)
    yield "model.norm.weight", (hidden,)
    if not cfg.get("tie_word_embeddings", False):
        yield "lm_head.weight", (vocab, hidden)


def num_params(cfg: dict[str, object]) -> int:
    """Total stored parameters (the tied embedding counted once)."""
    total = 0
    for _, shape in tensor_shapes(cfg):
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def main(argv: Sequence[str] | None = None) -> int:
    """Print a shape's size, its config.json and optionally its tensors (see the module docstring)."""
    p = argparse.ArgumentParser(description="The config.json and tensor shapes of a published Granite-4.0-H shape.")
    p.add_argument("--shape", required=True, choices=sorted(SHAPES))
    p.add_argument("--num-layers", type=int, default=None, help="keep the first N layers (see bench_config)")
    p.add_argument("--dtype", default="float32", help="torch_dtype written into the config")
    p.add_argument("--tensors", action="store_true", help="also every tensor's name and shape, in file order")
    args = p.parse_args(argv)
    try:
        cfg = bench_config(args.shape, num_layers=args.num_layers, dtype=args.dtype)
    except ValueError as e:
        p.error(str(e))
    kinds = list(cfg["layer_types"])  # type: ignore[call-overload]
    print(f"{args.shape}: {num_params(cfg) / 1e6:.1f}M parameters, {len(kinds)} layers "
          f"({kinds.count('attention')} attention, {kinds.count('mamba')} mamba)")  # fmt: skip
    if args.tensors:
        for name, shape in tensor_shapes(cfg):
            print(f"{name} {list(shape)}")
    print(json.dumps(cfg, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
