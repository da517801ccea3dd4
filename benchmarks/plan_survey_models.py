"""The models benchmarks/plan_survey.py times the execution plan over: one per family, with the family's real
widths but one layer of each kind (the plan is keyed per product shape, so deeper models add no shape).

Each is written as a random-weight checkpoint (the loader's parameter names, as
benchmarks/make_family_model.py writes them) and built the way a worker rank builds it
(`worker_proc.runtime.runner.ModelRunner`): `worker_proc.loading.checkpoint.load_model`,
`worker_proc.host.numerics.flush_subnormal_`, then `worker_proc.loading.quantize.quantize_model` for a
`--quantization`. Qwen3-Next's 512 experts of two layers would take 13 GB in float32: its checkpoint holds
`BUILT_EXPERTS` of them (a stack is timed on its first expert only, so its product shapes are the same), and
its router's product is timed at the real 512 outputs (`survey_instances` puts a router site of the real
shape in place of the reduced one).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field

import torch
from safetensors.torch import save_file
from torch import nn

from benchmarks.bench_model_shapes import SHAPES as GRANITE_SHAPES
from benchmarks.make_family_model import SHAPES as FAMILY_SHAPES
from benchmarks.make_family_model import truncate
from worker_proc.linear.site import GemmSite
from worker_proc.plan.execution_plan import product_sites
from worker_proc.plan.product_timer import Instance

logger = logging.getLogger(__name__)

BUILT_EXPERTS = 16
"""Experts a reduced MoE checkpoint holds (at least the family's top-k)."""

_TINY_MAMBA = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=4, mamba_d_head=32,
                   mamba_d_state=16, mamba_chunk_size=16, intermediate_size=128, shared_intermediate_size=128,
                   vocab_size=512)


@dataclass(frozen=True)
class FamilySpec:
    """`config`: the reduced config.json; `real_experts`: the router width timed in place of the built one
    (0: the built model's own); `tiny`: the changes of `--tiny` (small widths, for a smoke test)."""

    source: str
    config: dict[str, object]
    real_experts: int = 0
    tiny: dict[str, object] = field(default_factory=dict)
    tiny_real_experts: int = 0


def _granite_350m() -> dict[str, object]:
    return truncate(dict(GRANITE_SHAPES["granite-4.0-h-350m"]), 2)


FAMILIES: dict[str, FamilySpec] = {
    "granite-4.0-h-350m": FamilySpec("benchmarks.bench_model_shapes granite-4.0-h-350m", _granite_350m(),
                                     tiny=dict(_TINY_MAMBA)),
    "granite-4.0-h-tiny": FamilySpec(
        "benchmarks.make_family_model granite-4.0-h-tiny", truncate(FAMILY_SHAPES["granite-4.0-h-tiny"], 2),
        tiny=dict(_TINY_MAMBA, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                  shared_intermediate_size=64)),
    "nemotron-h": FamilySpec(
        "benchmarks.make_family_model nemotron-nano-9b-v2", truncate(FAMILY_SHAPES["nemotron-nano-9b-v2"], 3),
        tiny=dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                  mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=16,
                  vocab_size=512)),
    "qwen3-next": FamilySpec(
        "benchmarks.make_family_model qwen3-next-80b-a3b",
        dict(truncate(FAMILY_SHAPES["qwen3-next-80b-a3b"], 2), num_experts=BUILT_EXPERTS), real_experts=512,
        tiny=dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                  vocab_size=512),
        tiny_real_experts=8),
}


def family_config(name: str, tiny: bool) -> tuple[dict[str, object], int]:
    """(the config.json to write, the router width to time in place of the built one; 0: as built)."""
    spec = FAMILIES[name]
    cfg = dict(spec.config, torch_dtype="float32")
    if tiny:
        cfg.update(spec.tiny)
    return cfg, spec.tiny_real_experts if tiny else spec.real_experts


def write_checkpoint(out_dir: str, cfg: dict[str, object], seed: int = 0) -> str:
    """`cfg`'s config.json and random bfloat16 weights under the loader's names (as
    benchmarks.make_family_model.write: A_log spread over [log 1, log 16], norms and D 1, other vectors 0,
    matrices N(0, 1/in)). bfloat16 halves the file; the loader casts to the dtype surveyed."""
    import json

    from shared.families.registry import parse_config
    from worker_proc.model import HybridForCausalLM

    os.makedirs(out_dir, exist_ok=True)
    with torch.device("meta"):
        model = HybridForCausalLM(parse_config(cfg), torch.float32, "meta")
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            t = torch.log(torch.linspace(1.0, 16.0, p.shape[0]))
        elif p.dim() == 1:
            t = torch.ones(p.shape) if "norm" in name or name.endswith(".D") else torch.zeros(p.shape)
        else:
            t = torch.randn(p.shape, generator=gen).mul_(1 / math.sqrt(p.shape[-1]))
        tensors[name] = t.to(torch.bfloat16)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:  # last: a whole checkpoint or none
        json.dump(cfg, f, indent=1)
    logger.info("wrote %s: %d layers, %.1fM parameters", out_dir, model.cfg.num_layers,
                sum(t.numel() for t in tensors.values()) / 1e6)
    return out_dir


def load_survey_model(model_dir: str, dtype: str, quantization: str) -> nn.Module:
    """The model as a worker rank holds it before its plan is measured (worker_proc.runtime.runner.ModelRunner's
    steps: load, subnormals to zero, `--quantization`, LM head included)."""
    from worker_proc.host.numerics import flush_subnormal_
    from worker_proc.loading.checkpoint import load_model
    from worker_proc.loading.quantize import QuantScheme, quantize_model

    model = load_model(model_dir, device="cpu", dtype=dtype)
    flush_subnormal_(model)
    if quantization != "none":
        quantize_model(model, QuantScheme(quantization, lm_head=True))
    return model


def survey_instances(model: nn.Module, real_experts: int, seed: int = 1) -> list[Instance]:
    """The model's product sites (worker_proc.plan.execution_plan.instances_of), each MoE router (an owner's
    `gate_gemm`) replaced by a site of `real_experts` rows and a random weight of that shape where given."""
    out: list[Instance] = []
    gen = torch.Generator().manual_seed(seed)
    for owner, site, weight in product_sites(model):
        if real_experts and site is getattr(owner, "gate_gemm", None) and site.shape[0] != real_experts:
            real = GemmSite(real_experts, site.shape[1], site.dtype, packable=site.packable, quantizable=False)
            w = torch.randn(real_experts, site.shape[1], generator=gen).mul_(1 / math.sqrt(site.shape[1]))
            out.append((real, w.to(weight.dtype)))
            continue
        out.append((site, weight))
    return out
