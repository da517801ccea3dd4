"""The model registry: `config.json`'s `architectures[0]` -> the `Family` (shared.families.family)
whose module defines it. Torch-free: every process reads it; the scheduler and the tokenizer read
only `summary` (architecture, layer kinds, context length) and `text_fields`, the workers and the
launcher's start-up checks `parse_config`. Adding a family is one module and one line here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from shared.errors import ModelLoadError
from shared.families import bamba, falcon_h1, granite, jamba, kimi_linear, lfm2, mamba1, mamba2, nemotron_h, qwen3_next
from shared.families.family import Family
from shared.model_config import HybridConfig

T = TypeVar("T")
FAMILIES: dict[str, Family] = {
    "GraniteMoeHybridForCausalLM": granite.FAMILY,
    "NemotronHForCausalLM": nemotron_h.FAMILY,
    "BambaForCausalLM": bamba.FAMILY,
    "Mamba2ForCausalLM": mamba2.FAMILY,
    "FalconH1ForCausalLM": falcon_h1.FAMILY,
    "Qwen3NextForCausalLM": qwen3_next.FAMILY,
    "Qwen3_5ForCausalLM": qwen3_next.FAMILY,
    "Qwen3_5MoeForCausalLM": qwen3_next.FAMILY,
    "Qwen3_5ForConditionalGeneration": qwen3_next.FAMILY,
    "Qwen3_5MoeForConditionalGeneration": qwen3_next.FAMILY,
    "Lfm2ForCausalLM": lfm2.FAMILY,
    "Lfm2MoeForCausalLM": lfm2.FAMILY,
    "KimiLinearForCausalLM": kimi_linear.FAMILY,
    "MambaForCausalLM": mamba1.FAMILY,
    "FalconMambaForCausalLM": mamba1.FAMILY,
    "JambaForCausalLM": jamba.FAMILY,
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


def parse_config(cfg: dict, source: str = "config.json") -> HybridConfig:
    """The validated `HybridConfig` of a parsed config.json; ModelLoadError naming `source`."""
    arch = architecture_of(cfg, source)
    return _call(lambda: FAMILIES[arch].parse(cfg, arch), source)


def summary(cfg: dict, source: str = "config.json") -> tuple[str, tuple[str, ...], int]:
    """(architecture, layer kinds, context length) of a parsed config.json: what the processes other
    than the workers need; ModelLoadError naming `source`."""
    arch = architecture_of(cfg, source)
    family = FAMILIES[arch]
    kinds = _call(lambda: tuple(family.layer_kinds(cfg)), source)
    return arch, kinds, _call(lambda: int(family.context(cfg)), source)


def text_fields(cfg: dict) -> dict:
    """The fields of the language model (vocab_size, eos_token_id, ...): the family's `text_config`
    (a multimodal wrapper's), else `cfg`. Unknown architectures: `cfg`."""
    family = FAMILIES.get((cfg.get("architectures") or [""])[0])
    return cfg if family is None else family.text_config(cfg)


def _call(fn: Callable[[], T], source: str) -> T:
    try:
        return fn()
    except ModelLoadError as e:
        raise ModelLoadError(f"{source}: {e}") from e
    except KeyError as e:
        raise ModelLoadError(f"{source}: missing required field {e.args[0]!r}") from e
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{source}: {e}") from e
