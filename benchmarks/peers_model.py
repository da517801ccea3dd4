"""bench_peers' checkpoint: a directory as given, or one of make_family_model's shapes written once in
transformers' layout (make_family_model.write_transformers: transformers' class, init and save_pretrained with
the bench tokenizer), the layout llama.cpp's GGUF converter and transformers' column both need; hyssm's own
layout (its parameter names) is read by neither.

Rules: the shape's checkpoint lives in ``$XDG_CACHE_HOME/hyssm/bench-models/SHAPE-DTYPE-transformers`` (every
layer, --dtype weights) and is reused while its config.json names the shape's architecture and sizes; a folder
holding another shape is refused, never overwritten.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from benchmarks import make_family_model
from benchmarks.peers_procs import PeerError

logger = logging.getLogger(__name__)

SHAPE_KEYS = ("architectures", "hidden_size", "num_hidden_layers", "vocab_size")
"""The config.json fields a cached checkpoint must share with its shape."""


def is_shape(model: str) -> bool:
    """Whether --model names a make_family_model shape rather than a directory."""
    return model in make_family_model.SHAPES and not os.path.isdir(model)


def shape_dir(shape: str, dtype: str) -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hyssm" / "bench-models"
    return cache / f"{shape}-{dtype}-transformers"


def peers_checkpoint(model: str, dtype: str) -> str:
    """The checkpoint directory bench_peers serves for --model `model` (module docstring); PeerError when the
    shape's cache folder holds another model or transformers cannot build it."""
    if not is_shape(model):
        return model
    out = shape_dir(model, dtype)
    config = out / "config.json"
    if config.is_file():
        have, want = json.loads(config.read_text()), make_family_model.SHAPES[model]
        differ = [k for k in SHAPE_KEYS if k in want and have.get(k) != want[k]]
        if differ:
            raise PeerError(f"{out} holds another model than {model} (its {', '.join(differ)} differ)")
        logger.info("using the %s checkpoint in %s", model, out)
        return str(out)
    logger.info("writing a %s checkpoint (%s, transformers' layout and init) to %s", model, dtype, out)
    try:
        return make_family_model.write_transformers(str(out), model, dtype=dtype)
    except (ImportError, ValueError, FileExistsError) as e:
        raise PeerError(f"--model {model}: {e}") from None
