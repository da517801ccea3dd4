"""The native library's layout constants and op schemas each live in one place: the constants in
worker_proc/kernels/native/layout.py (given to the build as definitions, checked at load), the schemas in
schemas.cpp."""

from __future__ import annotations

import re

import pytest
import torch

from worker_proc.kernels import native
from worker_proc.kernels.native import layout

pytestmark = pytest.mark.skipif(not native.load(), reason="no native kernels on this machine")


def test_the_loaded_library_was_built_with_the_python_layout() -> None:
    assert list(torch.ops.hyssm_cpu.layout()) == list(layout.LAYOUT.values())
    assert all(flag in native.cflags() for flag in layout.defines())
    native.check_layout()


def test_a_build_with_another_layout_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "LAYOUT", {**layout.LAYOUT, "TILE_ROWS": 32})
    with pytest.raises(RuntimeError, match="built with layout"):
        native.check_layout()


def test_every_op_schema_is_declared_in_schemas_cpp_alone() -> None:
    sources = {p.name: p.read_text() for p in native.SOURCES}
    declared = re.findall(r'm\.def\(\s*"(\w+)\(', sources.pop("schemas.cpp"))
    assert not [name for name, text in sources.items() if "m.def(" in text and "class_" not in text]
    implemented = {op for text in sources.values() for op in re.findall(r'm\.impl\("(\w+)"', text)}
    assert implemented <= set(declared) and set(declared) - implemented == {"layout"}
    for op in declared:
        assert hasattr(torch.ops.hyssm_cpu, op), op
