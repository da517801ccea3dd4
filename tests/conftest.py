"""Suite-wide settings. Tests run on small CPU machines shared with the server processes they
start: one torch thread avoids OpenMP threads spinning against those processes. The fused CPU kernels
are built (or read from their cache) once before any test, so that no test's timeout pays the first
compile of a fresh machine."""

from __future__ import annotations


def pytest_configure(config: object) -> None:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return
    torch.set_num_threads(1)
    from worker_proc.kernels import native

    native.load()
