"""Mamba2ForCausalLM (state-spaces mamba2-130m ... 2.7b, Mamba-Codestral): Mamba2 mixers only, one
pre-normed block per layer (`norm`, `mixer`), no attention at all: no KV pool is allocated and the
scheduler sees zero attention layers. Its configs name no context limit: 65536 tokens unless
`max_position_embeddings` or --context-length says otherwise. Checkpoint names
`backbone.embeddings`, `backbone.norm_f` map onto the shared names. `residual_in_fp32` is exact in
float32; in 16-bit the residual stays in the model dtype."""

from __future__ import annotations

from shared.families.common import dtype_name
from shared.families.family import Family
from shared.families.fields import check_act, check_mamba, max_positions, num, time_step_limit
from shared.families.nemotron_h import RENAMES
from shared.model_config import Block, HybridConfig, MambaConfig, Sublayer

DEFAULT_CONTEXT = 1 << 16  # a Mamba2 config names no context limit; --context-length overrides


def context(cfg: dict) -> int:
    return max_positions(cfg) if cfg.get("max_position_embeddings") else DEFAULT_CONTEXT


def layer_kinds(cfg: dict) -> tuple[str, ...]:
    return ("mamba",) * int(cfg["num_hidden_layers"])


def parse(cfg: dict, arch: str) -> HybridConfig:
    hidden = int(cfg["hidden_size"])
    check_act(cfg, "hidden_act", "silu")
    heads, head_dim = int(cfg["num_heads"]), int(cfg.get("head_dim", 64))
    groups = int(cfg.get("n_groups", 1))
    inner = int(float(cfg.get("expand", 2)) * hidden)
    check_mamba(heads, groups, head_dim, inner, ("num_heads", "n_groups", "head_dim"))
    layers = int(cfg["num_hidden_layers"])
    return HybridConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        layer_kinds=layer_kinds(cfg),
        rms_norm_eps=num(cfg, "layer_norm_epsilon", 1e-5),
        max_position_embeddings=context(cfg),
        mamba=MambaConfig(
            n_heads=heads, n_groups=groups, d_state=int(cfg.get("state_size", 128)), d_head=head_dim,
            d_conv=int(cfg.get("conv_kernel", 4)), intermediate=inner, chunk_size=int(cfg.get("chunk_size", 256)),
            conv_bias=bool(cfg.get("use_conv_bias", True)), proj_bias=bool(cfg.get("use_bias", False)),
            time_step_limit=time_step_limit(cfg),
        ),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        torch_dtype=dtype_name(cfg),
        layer_specs=((Sublayer("norm", (Block("mamba", "mixer"),)),),) * layers,
        renames=RENAMES,
    )


FAMILY = Family(parse, layer_kinds, context=context)
