"""What the state-store tests share: a namespace, keys, stores of each backend."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from typing import Any

from shared.state_store import StoreNamespace

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE_FIELDS: dict[str, Any] = dict(model_config="c" * 64, weights="rev-1", dtype="bfloat16", quantization="",
                                        state_dtype="float32", tp_size=2, tp_rank=0, adapter_id="")


def namespace(**changes: Any) -> StoreNamespace:
    return StoreNamespace(**{**NAMESPACE_FIELDS, **changes})


def key(n: int) -> str:
    """A distinct valid key per n."""
    return hashlib.sha256(str(n).encode()).hexdigest()


def subprocess_env() -> dict[str, str]:
    """The environment of a child interpreter that imports this checkout's packages."""
    return {**os.environ, "PYTHONPATH": str(ROOT)}


PYTHON = sys.executable
