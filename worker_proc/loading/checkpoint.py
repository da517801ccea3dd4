"""Checkpoint loading: `config.json` + single-file or sharded safetensors -> `HybridForCausalLM`.

Every failure is a `ModelLoadError` whose message names the file, the architecture or the tensor at
fault. The tensors are read by worker_proc.loading.weight_files. A checkpoint whose config.json declares a
`quantization_config` is loaded by worker_proc.loading.prequantized, which never builds its dense weights.
"""

from __future__ import annotations

import logging
import os

import torch

from shared.errors import ModelLoadError
from shared.families.registry import parse_config
from shared.model_config import HybridConfig
from shared.model_info import read_config_json
from worker_proc.loading.checkpoint_config import CheckpointQuant, parse_quantization_config
from worker_proc.loading.prequantized import load_prequantized
from worker_proc.loading.weight_files import load_weights, weight_files
from worker_proc.model.hybrid import HybridForCausalLM
from worker_proc.model.tp import TPInfo

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_native_16bit(name: str) -> bool:
    """Whether this CPU multiplies `name` ("bfloat16" | "float16") natively (AVX512-BF16 or AMX for
    bf16, AMX-FP16 for fp16); without it torch emulates 16-bit GEMMs through float32 conversions and
    they run slower than plain float32."""
    if name == "bfloat16":
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    return bool(torch.cpu._is_amx_fp16_supported())


def resolve_dtype(name: str, device: torch.device, cfg: HybridConfig, native: bool | None = None) -> torch.dtype:
    """"auto" = the checkpoint's torch_dtype, as vLLM and SGLang serve it. A 16-bit dtype on a CPU without
    native arithmetic for it (auto's or asked for) computes in float32 instead, the log saying why: torch would
    emulate its matmuls through float32 conversions, only slower. `native` overrides the CPU probe (tests)."""
    asked = name
    if name == "auto":
        name = cfg.torch_dtype if cfg.torch_dtype in DTYPES else "float32"
    if name not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {name!r} (use one of {', '.join(DTYPES)} or auto)")
    if device.type == "cpu" and name in ("bfloat16", "float16"):
        if not (cpu_native_16bit(name) if native is None else native):
            logger.warning("dtype %s (%s): this CPU has no %s instructions, so its matmuls would be emulated and "
                           "slower than float32; the model computes in float32", name,
                           "the checkpoint's" if asked == "auto" else "asked for", name)
            return torch.float32
        logger.info("dtype %s (%s): this CPU multiplies it natively (half the weight traffic of float32)", name,
                    "the checkpoint's" if asked == "auto" else "asked for")
    return DTYPES[name]


def load_config(model_dir: str) -> HybridConfig:
    return parse_config(read_config_json(model_dir), os.path.join(model_dir, "config.json"))


def checkpoint_quantization(model_dir: str) -> CheckpointQuant | None:
    """How the checkpoint's weights are quantized (`quantization_config`), None for a dense one;
    ModelLoadError naming an unsupported method or scheme."""
    raw = read_config_json(model_dir).get("quantization_config")
    return parse_quantization_config(raw, os.path.join(model_dir, "config.json"))


def load_model(
    model_dir: str,
    *,
    device: str | torch.device = "cpu",
    dtype: str = "auto",
    tp_rank: int = 0,
    tp_size: int = 1,
    tp_group: object = None,
    mtp: bool = False,
) -> HybridForCausalLM:
    """Build the model described by `model_dir/config.json` on `device` and load its weights; `mtp`:
    with the checkpoint's MTP layers (ModelLoadError when it has none)."""
    cfg = load_config(model_dir)
    dev = torch.device(device)
    torch_dtype = resolve_dtype(dtype, dev, cfg)
    files = weight_files(model_dir)
    tp = TPInfo(tp_rank, tp_size, tp_group)
    stored = checkpoint_quantization(model_dir)
    if stored is not None:
        model = load_prequantized(cfg, stored, files, torch_dtype, dev, tp, mtp=mtp)
    else:
        model = HybridForCausalLM(cfg, torch_dtype, dev, tp, mtp=mtp)
        load_weights(model, files)
    model.after_loading()
    model.eval()
    letters = {"mamba": "M", "attention": "A", "parallel": "P", "gdn": "G", "short_conv": "C", "kda": "K",
               "mamba1": "S", "mlp": "-"}
    logger.info("loaded %s from %s: %d layers (%s)%s, %s on %s", cfg.architecture, model_dir, cfg.num_layers,
                "".join(letters[k] for k in cfg.layer_kinds), f" + {cfg.mtp_layers} MTP" if mtp else "",
                torch_dtype, dev)
    return model
