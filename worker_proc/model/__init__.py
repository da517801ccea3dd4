"""The hybrid Mamba2 + attention models of every registered family:
one decoder (`hybrid`), the shared blocks, the per-family config parsers (`families/`).

Names are imported lazily so that `worker_proc.model.config` (torch-free) can be read by the
launcher's start-up checks without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "HybridConfig": "worker_proc.model.config",
    "HybridForCausalLM": "worker_proc.model.hybrid",
    "StepBatch": "worker_proc.model.batch",
    "TPInfo": "worker_proc.model.tp",
    "build_step_batch": "worker_proc.model.batch",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
