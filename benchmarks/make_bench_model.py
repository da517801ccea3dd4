"""Write a random-weight checkpoint with the exact shapes of a real Granite-4.0-H model.

Needs torch, safetensors and tokenizers only (transformers too for ``--init transformers``):

    python benchmarks/make_bench_model.py --shape granite-4.0-h-350m /work/bench-models/granite-350m
    python benchmarks/make_bench_model.py --shape granite-4.0-h-tiny OUT --dtype bfloat16
    python benchmarks/make_bench_model.py --shape granite-4.0-h-350m OUT --init transformers

OUT gets config.json (architectures ["GraniteMoeHybridForCausalLM"]), model.safetensors (or, above
--max-shard-gb, model-0000k-of-0000n.safetensors + model.safetensors.index.json), tokenizer.json,
tokenizer_config.json and generation_config.json, in the Hugging Face layout that hyssm's loader,
transformers and llama.cpp's GGUF converter read. Shapes come from bench_model_shapes.SHAPES; the
tokenizer from bench_tokenizer (byte-level BPE, the model's vocabulary size, eos <|end_of_text|>).
Both inits write the same tensor names, shapes, file layout and other files; only the values differ.

``--init generator`` (the default; fixed by --seed, generated tensor by tensor so peak memory is about
one shard): every projection, embedding and router ~ N(0, initializer_range=0.02); norms 1; Mamba2 as
its reference init: A_log = log U(1, 16), D = 1, dt_bias = softplus^-1(dt) with dt log-uniform in
[1e-3, 1e-1], conv1d weight and bias U(-1/sqrt(d_conv), 1/sqrt(d_conv)). With these, activations stay
finite and logits stay input-dependent over long prompts (tests/bench checks 640 tokens).

``--init transformers``: the values transformers' own ``_init_weights`` gives this architecture
(``AutoModelForCausalLM.from_config`` of the written config in float32 after
``torch.manual_seed(--seed)``; in transformers 5: projections, embedding, router, experts and conv1d
weight ~ N(0, 0.02), the pad token's embedding row 0, conv1d bias 0, norms 1, A_log = log(1..heads),
D = 1, dt_bias = 1), renamed to the checkpoint names (the tied lm_head dropped) and cast to --dtype.
The whole model is held in float32 while it is written (4 bytes per parameter: 1.4 GB for the 350M
shape). Under these values the Mamba scan can produce subnormal floats, which slow a CPU down; use it
to see what a model built by transformers does, the generator init for weights like a trained model's.

Another family's shape (benchmarks/make_family_model.SHAPES) is written by make_family_model: with the
generator init its hyssm layout (float32, no tokenizer), with ``--init transformers`` its transformers layout.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import tempfile
import types
from collections.abc import Callable, Sequence
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
INITS = ("generator", "transformers")
# transformers' state_dict names whose checkpoint names differ (its MoE layout since version 5; earlier
# versions use the checkpoint names), as (transformers suffix, checkpoint suffix)
TRANSFORMERS_RENAMES = (
    (".block_sparse_moe.router.weight", ".block_sparse_moe.router.layer.weight"),
    (".block_sparse_moe.experts.gate_up_proj", ".block_sparse_moe.input_linear.weight"),
    (".block_sparse_moe.experts.down_proj", ".block_sparse_moe.output_linear.weight"),
)
TensorSource = Callable[[str, tuple[int, ...]], torch.Tensor]


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


def generator_source(cfg: dict[str, object], seed: int) -> TensorSource:
    """init_tensor from one generator seeded with `seed`; must be called in tensor_shapes order (each
    tensor's values depend on the draws before it)."""
    gen = torch.Generator().manual_seed(seed)
    return lambda name, shape: init_tensor(name, shape, cfg, gen)


def import_transformers() -> types.ModuleType:
    """transformers, or ImportError with a one-line message when it is not installed."""
    try:
        import transformers
    except ImportError:
        raise ImportError("--init transformers needs the transformers package (pip install transformers)") from None
    return transformers


def transformers_state(cfg: dict[str, object], seed: int) -> dict[str, torch.Tensor]:
    """The float32 tensors transformers initialises for `cfg` (AutoModelForCausalLM.from_config after
    torch.manual_seed(seed) in a forked RNG), under the checkpoint names of tensor_shapes(cfg): renamed by
    TRANSFORMERS_RENAMES, a tied lm_head.weight dropped. Raises ImportError (one line) without
    transformers, ValueError when names or shapes do not match tensor_shapes(cfg)."""
    transformers = import_transformers()
    with tempfile.TemporaryDirectory(prefix="bench-config-") as tmp:
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump({**cfg, "torch_dtype": "float32"}, f)  # transformers 5 builds in the config's dtype
        config = transformers.AutoConfig.from_pretrained(tmp)
    with torch.random.fork_rng(devices=[]):  # the caller's global RNG state is left as it was
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
    state: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        for theirs, ours in TRANSFORMERS_RENAMES:
            if name.endswith(theirs):
                name = name[: -len(theirs)] + ours
        state[name] = t.detach()
    del model
    want = dict(tensor_shapes(cfg))
    if cfg.get("tie_word_embeddings", False) and "lm_head.weight" not in want:
        state.pop("lm_head.weight", None)
    got = {n: tuple(t.shape) for n, t in state.items()}
    if got != want:
        diff = sorted(set(got.items()) ^ set(want.items()))[:4]
        raise ValueError(f"transformers {transformers.__version__}'s tensors differ from the checkpoint's: {diff}")
    if any(t.dtype != torch.float32 for t in state.values()):
        raise ValueError(f"transformers {transformers.__version__} did not build the model in float32")
    return state


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


def write_weights(out: str, cfg: dict[str, object], dtype: torch.dtype, source: TensorSource, max_shard_bytes: int,
                  show_progress: bool = True) -> list[str]:  # fmt: skip
    """Write the safetensors file(s) of tensor_shapes(cfg), each tensor source(name, shape) cast to
    `dtype`, asked for in tensor_shapes order; returns the file names."""
    shapes = list(tensor_shapes(cfg))
    elem = torch.empty((), dtype=dtype).element_size()
    shards = plan_shards(shapes, elem, max_shard_bytes)
    names = (["model.safetensors"] if len(shards) == 1
             else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])  # fmt: skip
    total = sum(math.prod(s) for _, s in shapes)
    weight_map: dict[str, str] = {}
    with tqdm(total=total * elem, unit="B", unit_scale=True, desc="writing weights", disable=not show_progress) as bar:
        for fname, idx in zip(names, shards, strict=True):
            tensors: dict[str, torch.Tensor] = {}
            for i in idx:
                name, shape = shapes[i]
                tensors[name] = source(name, shape).to(dtype).contiguous()
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
    init: str = "generator",
    num_layers: int | None = None,
    max_shard_gb: float = DEFAULT_MAX_SHARD_GB,
    show_progress: bool = True,
) -> dict[str, object]:
    """Write the whole checkpoint into `out` (created; must not hold a config.json) with the weights of
    `init` (see the module docstring); returns the config. config.json is written after the weights,
    so an interrupted write leaves none."""
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r} (use {' or '.join(DTYPES)})")
    if init not in INITS:
        raise ValueError(f"unsupported init {init!r} (use {' or '.join(INITS)})")
    if init == "transformers":
        import_transformers()  # before anything is written
    cfg = bench_config(shape, num_layers=num_layers, dtype=dtype)
    os.makedirs(out, exist_ok=True)
    if os.path.exists(os.path.join(out, "config.json")):
        raise FileExistsError(f"{out} already holds a checkpoint (config.json); choose an empty directory")
    ids = write_tokenizer(out, int(cfg["vocab_size"]))  # type: ignore[call-overload]
    cfg.update(eos_token_id=ids["eos"], bos_token_id=ids["eos"], pad_token_id=ids["pad"])
    if init == "transformers":
        state = transformers_state(cfg, seed)
        source: TensorSource = lambda name, shape: state.pop(name)  # frees each tensor once it is written
    else:
        source = generator_source(cfg, seed)
    files = write_weights(out, cfg, DTYPES[dtype], source, int(max_shard_gb * 2**30), show_progress)
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    gen_cfg = {"bos_token_id": ids["eos"], "eos_token_id": ids["eos"], "pad_token_id": ids["pad"]}
    with open(os.path.join(out, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump(gen_cfg, f, indent=2)
        f.write("\n")
    logger.info("wrote %s (%s, %s init, seed %d, %d layers) to %s: %s", shape, dtype, init, seed,
                cfg["num_hidden_layers"], out, ", ".join(files))  # fmt: skip
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    family_shapes = sorted(set(make_family_model.SHAPES) - set(SHAPES))
    p.add_argument("--shape", required=True, choices=sorted(SHAPES) + family_shapes,
                   help="a Granite-4.0-H shape (full checkpoint with tokenizer), or another family's shape, "
                        "written by benchmarks/make_family_model.py (--init generator: its hyssm layout, float32 "
                        "weights and config only; --init transformers: its transformers layout)")  # fmt: skip
    p.add_argument("out", help="output directory (created)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init", choices=INITS, default="generator",
                   help="generator: Mamba2 reference init (like a trained model); transformers: the values "
                        "transformers' from_config gives (needs transformers)")  # fmt: skip
    p.add_argument("--num-layers", type=int, default=None, help="keep only the first N layers (reduced model)")
    p.add_argument("--max-shard-gb", type=float, default=DEFAULT_MAX_SHARD_GB)
    p.add_argument("--log-level", default="INFO")
    ns = p.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if ns.max_shard_gb <= 0:
        p.error("--max-shard-gb must be > 0")
    if ns.shape in family_shapes:
        try:
            if ns.init == "transformers":  # make_family_model's transformers layout
                make_family_model.write_transformers(ns.out, ns.shape, ns.num_layers or 0, ns.seed, ns.dtype)
            else:
                make_family_model.write(ns.out, ns.shape, ns.num_layers or 0, ns.seed)
        except (ValueError, FileExistsError, ImportError) as e:
            p.error(str(e))
        return 0
    try:
        make_bench_model(ns.out, ns.shape, dtype=ns.dtype, seed=ns.seed, init=ns.init, num_layers=ns.num_layers,
                         max_shard_gb=ns.max_shard_gb)  # fmt: skip
    except (ValueError, FileExistsError, ImportError) as e:
        p.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
