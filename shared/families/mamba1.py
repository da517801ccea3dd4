"""MambaForCausalLM and FalconMambaForCausalLM (state-spaces mamba-130m ... 2.8b, tiiuae falcon-mamba-7b):
Mamba1 (selective scan) mixers only, one pre-normed block per layer (`norm`, `mixer`), no attention: no KV
pool is allocated and the scheduler sees zero attention layers. The mixer (worker_proc.model.mamba1):
d_inner = `intermediate_size` (else `expand` * hidden), `state_size`, `conv_kernel`, `time_step_rank`
("auto": ceil(hidden / 16)), `use_conv_bias`, `use_bias` (in_proj and out_proj); FalconMamba RMS-normalises
dt, B and C after x_proj without weights (`mixer_rms_eps`). Their configs name no context limit: 65536
tokens unless `max_position_embeddings` or --context-length says otherwise. Checkpoint names
`backbone.embeddings` (or `backbone.embedding`), `backbone.norm_f` map onto the shared names.
`residual_in_fp32` (transformers' default: true) carries the residual stream in float32 in a 16-bit model, as
transformers' blocks do (`HybridConfig.residual_fp32`); the mixers run in the model dtype.
"""

from __future__ import annotations

import math

from shared.families.common import dtype_name
from shared.families.family import Family
from shared.families.fields import check_act, max_positions, num
from shared.model_config import Block, HybridConfig, Mamba1Config, Sublayer

DEFAULT_CONTEXT = 1 << 16  # a Mamba config names no context limit; --context-length overrides
RENAMES = (
    (r"^backbone\.", "model."),
    (r"^model\.embeddings?\.", "model.embed_tokens."),
    (r"^model\.norm_f\.", "model.norm."),
)
"""Mamba / FalconMamba checkpoint names -> the shared blocks' parameter names."""


def context(cfg: dict) -> int:
    return max_positions(cfg) if cfg.get("max_position_embeddings") else DEFAULT_CONTEXT


def layer_kinds(cfg: dict) -> tuple[str, ...]:
    return ("mamba1",) * int(cfg["num_hidden_layers"])


def dt_rank(value: object, hidden: int) -> int:
    """`time_step_rank` / `mamba_dt_rank`: "auto" (or absent) is ceil(hidden / 16), as transformers takes it."""
    return math.ceil(hidden / 16) if value in (None, "auto") else int(value)  # type: ignore[call-overload]


def check_mamba1(part: Mamba1Config) -> None:
    for name in ("d_inner", "d_state", "dt_rank"):
        if getattr(part, name) <= 0:
            raise ValueError(f"Mamba1 {name} {getattr(part, name)} must be positive")
    if part.d_conv < 2:
        raise ValueError(f"conv kernel {part.d_conv} must be at least 2 (the conv keeps the last {part.d_conv - 1} "
                         "inputs)")


def parse(cfg: dict, arch: str) -> HybridConfig:
    hidden = int(cfg["hidden_size"])
    check_act(cfg, "hidden_act", "silu")
    inner = int(cfg.get("intermediate_size") or int(float(cfg.get("expand", 2)) * hidden))
    falcon = arch == "FalconMambaForCausalLM"
    part = Mamba1Config(
        d_inner=inner, d_state=int(cfg.get("state_size", 16)), d_conv=int(cfg.get("conv_kernel", 4)),
        dt_rank=dt_rank(cfg.get("time_step_rank"), hidden), conv_bias=bool(cfg.get("use_conv_bias", True)),
        proj_bias=bool(cfg.get("use_bias", False)), bcdt_norm="weightless" if falcon else "",
        norm_eps=num(cfg, "mixer_rms_eps", 1e-6),
    )
    check_mamba1(part)
    layers = int(cfg["num_hidden_layers"])
    return HybridConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        layer_kinds=layer_kinds(cfg),
        rms_norm_eps=num(cfg, "layer_norm_epsilon", 1e-5),
        max_position_embeddings=context(cfg),
        mamba1=part,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        torch_dtype=dtype_name(cfg),
        layer_specs=((Sublayer("norm", (Block("mamba1", "mixer"),)),),) * layers,
        residual_fp32=bool(cfg.get("residual_in_fp32", True)),
        renames=RENAMES,
    )


FAMILY = Family(parse, layer_kinds, context=context)
