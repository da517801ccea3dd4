"""What the non-worker processes need to know about a checkpoint, read from `config.json`.

The worker parses the full config itself (worker_proc); this is the torch-free subset the
scheduler and tokenizer use: layer kinds, EOS ids, context length, vocabulary size, and for a
checkpoint that sees (a `vision_config` beside the text model) its image tokens and patch geometry.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from shared.errors import ModelLoadError
from shared.families.registry import SUPPORTED_ARCHITECTURES, summary, text_fields
from shared.model_config import RECURRENT_KINDS, STATE_CONTENTS

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelInfo", "VisionInfo", "read_config_json"]


def _float_hook(obj: dict) -> object:
    # transformers writes float("inf") as {"__float__": "Infinity"} in time_step_limit
    if set(obj) == {"__float__"}:
        return float(obj["__float__"])
    return obj


def read_config_json(model_dir: str) -> dict:
    """Parse `model_dir/config.json`, decoding the `{"__float__": "Infinity"}` encoding."""
    if not os.path.isdir(model_dir):
        raise ModelLoadError(f"model path {model_dir!r} is not a directory")
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ModelLoadError(f"missing {path}")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        return json.loads(text, object_hook=_float_hook)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e


@dataclass(frozen=True)
class VisionInfo:
    """What the processes know of a checkpoint's vision tower: the placeholder token each image token
    is (`image_token_id`), the tokens around an image's placeholder in a prompt, and the patch geometry
    (one image token covers `spatial_merge_size` x `spatial_merge_size` patches of `patch_size` pixels)."""

    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    spatial_merge_size: int
    patch_size: int

    @staticmethod
    def from_config(cfg: dict, source: str) -> VisionInfo | None:
        """The wrapper's top-level token ids and its `vision_config`; None for a text-only checkpoint, and for a
        vision tower without `image_token_id` (no prompt can place an image for it)."""
        vision = cfg.get("vision_config")
        if not isinstance(vision, dict) or cfg.get("image_token_id") is None:
            return None
        try:
            return VisionInfo(image_token_id=int(cfg["image_token_id"]),
                              vision_start_token_id=int(cfg["vision_start_token_id"]),
                              vision_end_token_id=int(cfg["vision_end_token_id"]),
                              spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
                              patch_size=int(vision.get("patch_size", 16)))  # fmt: skip
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{source}: a vision_config needs integer image_token_id, vision_start_token_id "
                                 f"and vision_end_token_id ({e!r})") from None


@dataclass(frozen=True)
class ModelInfo:
    architecture: str
    # "mamba" | "attention" | "parallel" (both) | "gdn" | "short_conv" | "kda" | "mamba1" | "mlp" (none)
    layer_kinds: tuple[str, ...]
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_position_embeddings: int
    vision: VisionInfo | None = None  # None: a text-only checkpoint

    @property
    def has_recurrent_state(self) -> bool:
        """True when a layer carries a recurrent state (Mamba, Gated DeltaNet, short convolutions, KDA):
        requests then need a state slot, which the scheduler tracks, checkpoints and copies on write."""
        return any(k in RECURRENT_KINDS for k in self.layer_kinds)

    @property
    def state_kinds(self) -> dict[str, str]:
        """What one state slot holds per recurrent layer kind of the model, in layer order (empty for a
        model without recurrent layers): /get_model_info's `state_kinds`."""
        return {k: STATE_CONTENTS[k] for k in dict.fromkeys(self.layer_kinds) if k in STATE_CONTENTS}

    @property
    def has_attention(self) -> bool:
        return any(k in ("attention", "parallel") for k in self.layer_kinds)

    @staticmethod
    def from_dir(model_dir: str) -> ModelInfo:
        cfg = read_config_json(model_dir)
        vision = VisionInfo.from_config(cfg, f"{model_dir}/config.json")
        arch, kinds, context = summary(cfg, f"{model_dir}/config.json")  # the family's layout (torch-free)
        cfg = text_fields(cfg)  # a multimodal wrapper's text model
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return ModelInfo(
            architecture=arch,
            layer_kinds=kinds,
            vocab_size=int(cfg["vocab_size"]),
            eos_token_ids=eos_ids,
            max_position_embeddings=context,
            vision=vision,
        )
