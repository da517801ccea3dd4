"""Random small GraniteMoeHybrid checkpoints for layouts the HF parity fixtures do not cover:
n_groups that neither divides nor is divided evenly by the rank count,
KV heads replicated over several ranks, MoE. Deterministic in `seed`."""

from __future__ import annotations

import json
import math
import os

import torch
from safetensors.torch import save_file

from tests.worker.util import fixture_dir
from worker_proc.loading.checkpoint import load_config
from worker_proc.model import HybridForCausalLM

BASE = "nope_groups2"


def make_checkpoint(out_dir: str, seed: int = 0, **overrides: object) -> str:
    """config.json = the `nope_groups2` fixture's config with `overrides`; weights random."""
    with open(os.path.join(fixture_dir(BASE), "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg.update(overrides)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=1)
    model = HybridForCausalLM(load_config(out_dir), torch.float32, "cpu")
    gen = torch.Generator().manual_seed(seed)
    tensors = {name: _init(name, p.shape, gen) for name, p in model.named_parameters()}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    return out_dir


def _init(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    if name.endswith("A_log"):
        return torch.log(torch.linspace(1.0, 8.0, shape[0]))
    if name.endswith(".D"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith("dt_bias"):
        return 0.5 * torch.randn(shape, generator=gen)
    if name.endswith("norm.weight"):
        return 1.0 + 0.2 * torch.randn(shape, generator=gen)
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=gen)
    fan_in = shape[-1] if len(shape) > 1 else 1
    return torch.randn(shape, generator=gen) / math.sqrt(max(fan_in, 4))
