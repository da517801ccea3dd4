"""A pytest plugin (`-p tests.isa_library --native-library PATH`): the tests run against a build of the
fused CPU kernels made by `native.compile_library` for another `-march`, loaded in place of this
machine's own build (a process holds one build of `torch.ops.hyssm_cpu`)."""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--native-library", default="", help="a compiled hyssm_cpu_ops library to test")


@pytest.hookimpl(tryfirst=True)  # before the suite's conftest loads this machine's build
def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--native-library")
    if not path:
        return
    import torch

    from worker_proc.kernels import native

    torch.ops.load_library(str(Path(path)))
    native._load = lambda: (True, "")  # noqa: SLF001 - the loaded build stands in for this machine's


def pytest_report_header(config: pytest.Config) -> str:
    path = config.getoption("--native-library")
    return f"fused CPU kernels: {path}" if path else ""
