"""Write a random-weight checkpoint with the exact shapes of a real Granite-4.0-H model.

Needs torch, safetensors and tokenizers only (not transformers):

    python benchmarks/make_bench_model.py --shape granite-4.0-h-350m /work/bench-models/granite-350m
    python benchmarks/make_bench_model.py --shape granite-4.0-h-tiny OUT --dtype bfloat16

OUT gets config.json (architectures ["GraniteMoeHybridForCausalLM"]), model.safetensors (or, above
--max-shard-gb, model-0000k-of-0000n.safetensors + model.safetensors.index.json), tokenizer.json,
tokenizer_config.json and generation_config.json, in the Hugging Face layout that hyssm's loader,
transformers and llama.cpp's GGUF converter read. Shapes come from bench_model_shapes.SHAPES; the
tokenizer from bench_tokenizer (byte-level BPE, the model's vocabulary size, eos <|end_of_text|>).

Weights (fixed by --seed, generated tensor by tensor so peak memory is about one shard): every
projection, embedding and router ~ N(0, initializer_range=0.02); norms 1; Mamba2 as its reference
init: A_log = log U(1, 16), D = 1, dt_bias = softplus^-1(dt) with dt log-uniform in [1e-3, 1e-1],
conv1d weight and bias U(-1/sqrt(d_conv), 1/sqrt(d_conv)). With these, activations stay finite
and logits stay input-dependent over long prompts (tests/bench checks 640 tokens).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

if __package__ in (None, ""):  # run as a file: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import make_family_model
from benchmarks.bench_model_shapes import SHAPES, bench_config, tensor_shapes  # noqa: E402
from benchmarks.bench_tokenizer import write_tokenizer  # noqa: E402

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_MAX_SHARD_GB = 4.0


def init_tensor(name: str, shape: tuple[int, ...], cfg: dict[str, object], gen: torch.Generator) -> torch.Tensor:
    """One float32 tensor initialised by its role (see the module docstring)."""
    if name.endswith("mamba.A_log"):
        return torch.log(torch.empty(shape).uniform_(1.0, 16.0, generator=gen))
    if name.endswith("mamba.D") or name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return torch.ones(shape)
    if name.endswith("mamba.dt_bias"):
        u = torch.rand(shape, generator=gen)
        dt = torch.exp(u * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
        return dt + torch.log(-torch.expm1(-dt))
    if "conv1d." in name:
        bound = 1.0 / math.sqrt(int(cfg["mamba_d_conv"]))  # type: ignore[call-overload]
        return torch.empty(shape).uniform_(-bound, bound, generator=gen)
    std = float(cfg.get("initializer_range", 0.02))  # type: ignore[arg-type]
    return torch.empty(shape).normal_(0.0, std, generator=gen)


def plan_shards(shapes: list[tuple[str, tuple[int, ...]]], elem_bytes: int, max_bytes: int) -> list[list[int]]:
    """Indices of `shapes` grouped into consecutive shards of at most max_bytes (a tensor larger than
    that gets a shard of its own)."""
    shards: list[list[int]] = [[]]
    size = 0
    for i, (_, shape) in enumerate(shapes):
        nbytes = math.prod(shape) * elem_bytes
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes
    return shards


def write_weights(out: str, cfg: dict[str, object], dtype: torch.dtype, seed: int, max_shard_bytes: int,
                  show_progress: bool = True) -> list[str]:  # fmt: skip
    """Write the safetensors file(s); returns their names."""
    shapes = list(tensor_shapes(cfg))
    elem = torch.empty((), dtype=dtype).element_size()
    shards = plan_shards(shapes, elem, max_shard_bytes)
    names = (["model.safetensors"] if len(shards) == 1
             else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    total = sum(math.prod(s) for _, s in shapes)
    weight_map: dict[str, str] = {}
    with tqdm(total=total * elem, unit="B", unit_scale=True, desc="writing weights", disable=not show_progress) as bar:
        for fname, idx in zip(names, shards, strict=True):
            tensors: dict[str, torch.Tensor] = {}
            for i in idx:
                name, shape = shapes[i]
                tensors[name] = init_tensor(name, shape, cfg, gen).to(dtype).contiguous()
                weight_map[name] = fname
                bar.update(math.prod(shape) * elem)
            save_file(tensors, os.path.join(out, fname), metadata={"format": "pt"})
            del tensors
    if len(names) > 1:
        index = {"metadata": {"total_size": total * elem}, "weight_map": weight_map}
        with open(os.path.join(out, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
    return names


def make_bench_model(
    out: str,
    shape: str,
    *,
    dtype: str = "float32",
    seed: int = 0,
    num_layers: int | None = None,
    max_shard_gb: float = DEFAULT_MAX_SHARD_GB,
    show_progress: bool = True,
) -> dict[str, object]:
    """Write the whole checkpoint into `out` (created; must not hold a config.json); returns the config."""
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r} (use {' or '.join(DTYPES)})")
    cfg = bench_config(shape, num_layers=num_layers, dtype=dtype)
    os.makedirs(out, exist_ok=True)
    if os.path.exists(os.path.join(out, "config.json")):
        raise FileExistsError(f"{out} already holds a checkpoint (config.json); choose an empty directory")
    ids = write_tokenizer(out, int(cfg["vocab_size"]))  # type: ignore[call-overload]
    cfg.update(eos_token_id=ids["eos"], bos_token_id=ids["eos"], pad_token_id=ids["pad"])
    files = write_weights(out, cfg, DTYPES[dtype], seed, int(max_shard_gb * 2**30), show_progress)
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    gen_cfg = {"bos_token_id": ids["eos"], "eos_token_id": ids["eos"], "pad_token_id": ids["pad"]}
    with open(os.path.join(out, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump(gen_cfg, f, indent=2)
        f.write("\n")
    logger.info("wrote %s (%s, seed %d, %d layers) to %s: %s", shape, dtype, seed,
                cfg["num_hidden_layers"], out, ", ".join(files))  # fmt: skip
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    family_shapes = sorted(set(make_family_model.SHAPES) - set(SHAPES))
    p.add_argument("--shape", required=True, choices=sorted(SHAPES) + family_shapes,
                   help="a Granite-4.0-H shape (full checkpoint with tokenizer), or another family's shape "
                        "(weights and config only, as benchmarks/make_family_model.py writes them)")  # fmt: skip
    p.add_argument("out", help="output directory (created)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-layers", type=int, default=None, help="keep only the first N layers (reduced model)")
    p.add_argument("--max-shard-gb", type=float, default=DEFAULT_MAX_SHARD_GB)
    p.add_argument("--log-level", default="INFO")
    ns = p.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if ns.max_shard_gb <= 0:
        p.error("--max-shard-gb must be > 0")
    if ns.shape in family_shapes:
        make_family_model.write(ns.out, ns.shape, ns.num_layers or 0, ns.seed)
        return 0
    try:
        make_bench_model(ns.out, ns.shape, dtype=ns.dtype, seed=ns.seed, num_layers=ns.num_layers,
                         max_shard_gb=ns.max_shard_gb)  # fmt: skip
    except (ValueError, FileExistsError) as e:
        p.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
