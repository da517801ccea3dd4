"""The one door through which every process reads an adapter directory: `read_checked` gives the checked
`LoraAdapter` for this server (its model's config, `--max-lora-rank`) or raises `LoraError` with a one-line
message. The tokenizer reads `--lora-paths` at start and POST /load_lora_adapter's paths; the scheduler
reads `--lora-paths` at start too, so both know the same uids without a start-up exchange.
The checks themselves are shared/lora.py's `read_adapter`.
"""

from __future__ import annotations

import functools
import logging
import os

from shared.config import ServerArgs
from shared.errors import ModelLoadError
from shared.families.registry import parse_config
from shared.lora import LoraError, read_adapter
from shared.messages import LoraAdapter
from shared.model_config import HybridConfig
from shared.model_info import read_config_json

logger = logging.getLogger(__name__)

__all__ = ["LoraError", "read_checked", "startup_adapters"]


@functools.lru_cache(maxsize=4)
def _model_config(model_dir: str) -> HybridConfig:
    try:
        return parse_config(read_config_json(model_dir), os.path.join(model_dir, "config.json"))
    except (OSError, ValueError, ModelLoadError) as e:
        raise LoraError(f"LoRA adapters need the served model's config.json: {e}") from None


def read_checked(name: str, path: str, args: ServerArgs) -> LoraAdapter:
    """The adapter at `path`, checked against the served model and --max-lora-rank (LoraError otherwise)."""
    return read_adapter(name, path, _model_config(args.resolved_model_path), args.max_lora_rank)


def startup_adapters(args: ServerArgs) -> list[LoraAdapter]:
    """Every --lora-paths adapter, checked (the first bad one raises LoraError); none while LoRA is off."""
    if not args.enable_lora:
        return []
    return [read_checked(name, path, args) for name, path in args.lora_path_map().items()]
