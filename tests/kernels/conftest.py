"""Kernel tests run the Triton kernels on CPU tensors through the Triton interpreter.

Owned by the Triton kernel path (helper E). TRITON_INTERPRET must be set before any
`worker_proc.kernels.triton_*` module is imported: `@triton.jit` decides at decoration time whether
a kernel is compiled or interpreted. This conftest is imported before the test modules of this
directory, so setting it here (and not in the environment of the whole suite) is enough;
`test_interpreter_is_active` fails loudly if some earlier import defeated it.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded generator: every kernel test draws its inputs from it (reproducible failures)."""
    return torch.Generator().manual_seed(1234)
