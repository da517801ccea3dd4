"""Suite-wide settings. Tests run on small CPU machines shared with the server processes they
start: one torch thread avoids OpenMP threads spinning against those processes."""

from __future__ import annotations


def pytest_configure(config: object) -> None:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return
    torch.set_num_threads(1)
