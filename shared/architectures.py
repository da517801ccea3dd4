"""The model registry: `config.json`'s `architectures[0]` -> the family module that defines it.

Torch-free (every process reads it). A family module under `worker_proc/model/families/` has
`parse(cfg: dict, arch: str) -> HybridConfig`: it maps the family's config fields onto the shared
description (`worker_proc.model.config`), including the arrangement of the shared blocks in each
layer and the checkpoint's tensor names; and `layer_kinds(cfg) -> tuple[str, ...]` (plus, when its
configs may lack `max_position_embeddings`, `DEFAULT_CONTEXT`; when its fields live elsewhere than
the top level, e.g. a multimodal wrapper's `text_config`, `text_config(cfg) -> dict` and
`context(cfg) -> int`), which is all the scheduler and the tokenizer read (`summary`: only the
layout fields are required). Adding a family is one module and
one line here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from shared.errors import ModelLoadError

if TYPE_CHECKING:
    from worker_proc.model.config import HybridConfig

T = TypeVar("T")
FAMILIES: dict[str, str] = {
    "GraniteMoeHybridForCausalLM": "granite",
    "NemotronHForCausalLM": "nemotron_h",
    "BambaForCausalLM": "bamba",
    "Mamba2ForCausalLM": "mamba2",
    "FalconH1ForCausalLM": "falcon_h1",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5ForCausalLM": "qwen3_next",
    "Qwen3_5MoeForCausalLM": "qwen3_next",
    "Qwen3_5ForConditionalGeneration": "qwen3_next",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_next",
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)


def architecture_of(cfg: dict, source: str) -> str:
    """`architectures[0]`, or a one-line ModelLoadError listing the supported architectures."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else ""
    if arch not in FAMILIES:
        raise ModelLoadError(
            f"unsupported architecture {arch!r} in {source} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return arch


def family_module(arch: str) -> object:
    return importlib.import_module(f"worker_proc.model.families.{FAMILIES[arch]}")


def parse_config(cfg: dict, source: str = "config.json") -> HybridConfig:
    """The validated `HybridConfig` of a parsed config.json; ModelLoadError naming `source`."""
    arch = architecture_of(cfg, source)
    return _call(lambda: family_module(arch).parse(cfg, arch), source)  # type: ignore[attr-defined]


def summary(cfg: dict, source: str = "config.json") -> tuple[str, tuple[str, ...], int]:
    """(architecture, layer kinds, context length) of a parsed config.json: what the processes other
    than the workers need; ModelLoadError naming `source`."""
    from worker_proc.model.config import max_positions

    arch = architecture_of(cfg, source)
    family = family_module(arch)
    kinds = _call(lambda: tuple(family.layer_kinds(cfg)), source)  # type: ignore[attr-defined]
    default = getattr(family, "DEFAULT_CONTEXT", None)
    context = max_positions(cfg) if default is None or cfg.get("max_position_embeddings") else default
    if hasattr(family, "context"):
        context = _call(lambda: int(family.context(cfg)), source)  # type: ignore[attr-defined]
    return arch, kinds, context


def text_fields(cfg: dict) -> dict:
    """The fields of the language model (vocab_size, eos_token_id, ...): the family's `text_config`
    when it has one (a multimodal wrapper's), else `cfg`. Unknown architectures: `cfg`."""
    arch = (cfg.get("architectures") or [""])[0]
    family = family_module(arch) if arch in FAMILIES else None
    fn = getattr(family, "text_config", None)
    return fn(cfg) if callable(fn) else cfg


def _call(fn: Callable[[], T], source: str) -> T:
    try:
        return fn()
    except ModelLoadError as e:
        raise ModelLoadError(f"{source}: {e}") from e
    except KeyError as e:
        raise ModelLoadError(f"{source}: missing required field {e.args[0]!r}") from e
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{source}: {e}") from e
