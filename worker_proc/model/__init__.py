"""The hybrid models of every registered family (shared.families): one decoder (`hybrid`) and the
shared blocks it arranges. Names are imported lazily: importing the package loads no torch module."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
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
