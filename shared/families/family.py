"""`Family`: what one model family module gives the registry (shared.families.registry), and the
defaults a family without its own rule takes. Torch-free: every process reads it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shared.families.fields import max_positions
from shared.model_config import HybridConfig


def top_level(cfg: dict) -> dict:
    """A config whose language-model fields stand at its top level (every family but a wrapper's)."""
    return cfg


@dataclass(frozen=True)
class Family:
    """A family's rules over a parsed `config.json`:
    - `parse(cfg, arch)`: the validated `HybridConfig` (sizes, the arrangement of the shared blocks
      in each layer, checkpoint renames); raises ModelLoadError, KeyError, TypeError or ValueError;
    - `layer_kinds(cfg)`: per layer "mamba" | "attention" | "parallel" | "gdn" | "short_conv" | "kda" | "mamba1" | "mlp"
      (all that the scheduler and the tokenizer need of the layout);
    - `context(cfg)`: the context length the config gives;
    - `text_config(cfg)`: the language model's fields (a multimodal wrapper's `text_config`)."""

    parse: Callable[[dict, str], HybridConfig]
    layer_kinds: Callable[[dict], tuple[str, ...]]
    context: Callable[[dict], int] = max_positions
    text_config: Callable[[dict], dict] = top_level
