"""FalconH1ForCausalLM (TII Falcon-H1 0.5B-34B): in every layer attention and a Mamba2 mixer run in
parallel on the same `input_layernorm` output and their outputs are summed, then a split gated SiLU
MLP (`feed_forward` after `pre_ff_layernorm`). Every muP multiplier is applied where the reference
applies it: `embedding_multiplier`, `lm_head_multiplier`, `attention_in/out_multiplier`,
`key_multiplier`, `ssm_in/out_multiplier`, the per-segment `ssm_multipliers` of in_proj (z, x, B, C,
dt) and `mlp_multipliers` (gate, down). `mamba_d_ssm` sets the Mamba width; `mamba_rms_norm` and
`mamba_norm_before_gate` choose the output norm; out_proj's bias is `projectors_bias`. RoPE on every
attention layer. The final norm `model.final_layernorm` maps onto the shared `model.norm`."""

from __future__ import annotations

from shared.families.bamba import RENAMES, attention_part
from shared.families.common import dtype_name, mamba_part
from shared.families.family import Family
from shared.families.fields import check_act, max_positions, num
from shared.model_config import Block, HybridConfig, MlpConfig, Sublayer


def _floats(cfg: dict, key: str, n: int) -> tuple[float, ...]:
    values = cfg.get(key)
    if values is None:
        return (1.0,) * n
    if len(values) != n:
        raise ValueError(f"{key} has {len(values)} values, expected {n}")
    return tuple(float(v) for v in values)


def layer_kinds(cfg: dict) -> tuple[str, ...]:
    return ("parallel",) * int(cfg["num_hidden_layers"])


def parse(cfg: dict, arch: str) -> HybridConfig:
    hidden = int(cfg["hidden_size"])
    check_act(cfg, "hidden_act", "silu")
    n = int(cfg["num_hidden_layers"])
    d_ssm = cfg.get("mamba_d_ssm")
    inner = int(cfg.get("mamba_expand", 2)) * hidden if d_ssm is None else int(d_ssm)
    mixers = Sublayer("input_layernorm", (
        Block("mamba", "mamba", in_multiplier=num(cfg, "ssm_in_multiplier", 1.0),
              out_multiplier=num(cfg, "ssm_out_multiplier", 1.0)),
        Block("attention", "self_attn", in_multiplier=num(cfg, "attention_in_multiplier", 1.0),
              out_multiplier=num(cfg, "attention_out_multiplier", 1.0)),
    ))
    ffn = Sublayer("pre_ff_layernorm", (Block("gated_mlp", "feed_forward", int(cfg["intermediate_size"]),
                                              "intermediate_size"),))
    return HybridConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        layer_kinds=layer_kinds(cfg),
        rms_norm_eps=num(cfg, "rms_norm_eps", 1e-5),
        max_position_embeddings=max_positions(cfg),
        embedding_multiplier=num(cfg, "embedding_multiplier", 1.0),
        residual_multiplier=1.0,
        logits_scaling=1.0,
        lm_head_multiplier=num(cfg, "lm_head_multiplier", 1.0),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        torch_dtype=dtype_name(cfg),
        layer_specs=((mixers, ffn),) * n,
        attn=attention_part(cfg, 1.0, key_multiplier=num(cfg, "key_multiplier", 1.0)),
        mamba=mamba_part(
            cfg, inner, norm=bool(cfg.get("mamba_rms_norm", False)),
            norm_before_gate=bool(cfg.get("mamba_norm_before_gate", True)),
            multipliers=_floats(cfg, "ssm_multipliers", 5), out_proj_bias=bool(cfg.get("projectors_bias", False)),
        ),
        mlp=MlpConfig(bias=bool(cfg.get("mlp_bias", False)), multipliers=_floats(cfg, "mlp_multipliers", 2)),
        renames=RENAMES,
    )


FAMILY = Family(parse, layer_kinds)
