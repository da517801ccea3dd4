"""The model registry: `config.json`'s `architectures[0]` -> the family module that defines it.

Torch-free (every process reads it). A family module under `worker_proc/model/families/` has
`parse(cfg: dict, arch: str) -> HybridConfig`: it maps the family's config fields onto the shared
description (`worker_proc.model.config`), including the arrangement of the shared blocks in each
layer and the checkpoint's tensor names (`worker_proc.model.families.common.Family`). Adding a
family is one module and one line here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from shared.errors import ModelLoadError

if TYPE_CHECKING:
    from worker_proc.model.config import HybridConfig

FAMILIES: dict[str, str] = {
    "GraniteMoeHybridForCausalLM": "granite",
    "NemotronHForCausalLM": "nemotron_h",
    "BambaForCausalLM": "bamba",
    "Mamba2ForCausalLM": "mamba2",
    "FalconH1ForCausalLM": "falcon_h1",
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
    try:
        return family_module(arch).parse(cfg, arch)  # type: ignore[attr-defined]
    except ModelLoadError as e:
        raise ModelLoadError(f"{source}: {e}") from e
    except KeyError as e:
        raise ModelLoadError(f"{source}: missing required field {e.args[0]!r}") from e
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{source}: {e}") from e
