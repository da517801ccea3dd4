"""Kernel tests run the Triton kernels on CPU tensors through the Triton interpreter.

`@triton.jit` decides when a kernel module is imported
whether its kernels are compiled or interpreted, so this conftest (imported before the test modules
of this directory) imports every kernel module with TRITON_INTERPRET=1 and then restores the
variable; an autouse fixture sets it again only while each test of this directory runs, so the
rest of the suite, and the processes it starts, never inherit it.
`test_interpreter_is_active` fails loudly if an earlier import of the kernel modules defeated this.
"""

from __future__ import annotations

import os

import pytest
import torch

_before = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    import triton.experimental.gluon  # noqa: F401  (triton imports it lazily at the first launch; it checks the mode)

    import worker_proc.kernels.triton.ops  # noqa: F401  (imports every kernel module: interpreted)
finally:
    if _before is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _before


@pytest.fixture(autouse=True)
def _interpreter_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """TRITON_INTERPRET=1 while a kernel test runs (triton consults it at run time too), unset after."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded generator: every kernel test draws its inputs from it (reproducible failures)."""
    return torch.Generator().manual_seed(1234)
