"""A torch-free reader of a PEFT LoRA adapter directory, standing in for shared/lora.py `read_adapter` until
that lands: the tokenizer reaches it only through tokenizer_proc/requests/adapters.py `read_checked`.

What it checks: the directory holds `adapter_config.json` (a LoRA config: `r` in 1..max_rank, `lora_alpha`,
`use_rslora`, `target_modules` among the linear layers hybrid checkpoints name) and the weights
(`adapter_model.safetensors` or `adapter_model.bin`). It does not compare the weights' shapes with the base
model (shared/lora.py does). `uid` is a digest of both files' bytes, so an adapter replaced under the same
name gets another uid.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os

from shared.messages import LoraAdapter
from shared.model_config import HybridConfig

logger = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
TARGETS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "down_proj",
                     "gate_up_proj", "in_proj", "out_proj", "input_linear", "output_linear", "shared_mlp"})
"""The linear layers of the served families an adapter may target."""


class LoraError(ValueError):
    """An adapter that cannot be served; the message is one line naming it."""


def _config(name: str, path: str) -> dict:
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise LoraError(f"LoRA adapter {name!r}: {path!r} is not a directory")
    try:
        with open(file, encoding="utf-8") as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise LoraError(f"LoRA adapter {name!r}: {path!r} has no {CONFIG_FILE}") from None
    except (OSError, ValueError) as e:
        raise LoraError(f"LoRA adapter {name!r}: {CONFIG_FILE} cannot be read: {e}") from None
    if not isinstance(cfg, dict):
        raise LoraError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    return cfg


def _targets(name: str, cfg: dict) -> tuple[str, ...]:
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise LoraError(f"LoRA adapter {name!r}: target_modules must be a list of module names")
    unknown = sorted({t.rsplit(".", 1)[-1] for t in targets} - TARGETS)
    if unknown:
        raise LoraError(f"LoRA adapter {name!r}: unknown target module(s) {', '.join(unknown)} (known: "
                        f"{', '.join(sorted(TARGETS))})")
    return tuple(sorted({t.rsplit(".", 1)[-1] for t in targets}))


def read_adapter(name: str, path: str, cfg: HybridConfig | None, max_rank: int) -> LoraAdapter:
    """The checked adapter at `path` (LoraError with a one-line message otherwise)."""
    conf = _config(name, path)
    if str(conf.get("peft_type", "LORA")).upper() != "LORA":
        raise LoraError(f"LoRA adapter {name!r}: peft_type is {conf.get('peft_type')!r}, not LORA")
    rank = conf.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoraError(f"LoRA adapter {name!r}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoraError(f"LoRA adapter {name!r}: rank {rank} is above --max-lora-rank {max_rank}")
    alpha = conf.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise LoraError(f"LoRA adapter {name!r}: lora_alpha must be a positive number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if conf.get("use_rslora") else alpha / rank
    targets = _targets(name, conf)
    weights = next((os.path.join(path, w) for w in WEIGHT_FILES if os.path.isfile(os.path.join(path, w))), None)
    if weights is None:
        raise LoraError(f"LoRA adapter {name!r}: {path!r} has no {' or '.join(WEIGHT_FILES)}")
    digest = hashlib.sha256()
    for file in (os.path.join(path, CONFIG_FILE), weights):
        with open(file, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return LoraAdapter(name=name, path=os.path.abspath(path), uid=digest.hexdigest()[:32], rank=rank,
                       scaling=float(scaling), targets=targets)
