from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.server import Server, running_server


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """One built-in-model server for the module (tight pools so capacity paths are exercised)."""
    with running_server(["--max-running-requests", "16", "--random-seed", "0"]) as srv:
        yield srv
