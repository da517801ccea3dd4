"""Fixtures of the benchmark-tool tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.bench.fake_server import FakeServer


@pytest.fixture(scope="module")
def server() -> Iterator[FakeServer]:
    srv = FakeServer()
    try:
        yield srv
    finally:
        srv.stop()
