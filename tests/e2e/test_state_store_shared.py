"""One state store, two servers: a prefix one server prefilled is a load on the other, which never saw
it, and the outputs are the same (issue 57, "persistent and shared")."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from tests.e2e.server import DETERMINISTIC, Server, running_server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

BLOCK = 32


def body(ids: list[int], n: int) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}


def wait_for_writes(server: Server, entries: int, timeout: float = 60.0) -> None:
    """Until the server's writer has stored `entries` entries (its counter, polled)."""
    deadline = time.monotonic() + timeout
    while server.metric("hyssm_state_store_entries_total", op="write") < entries:
        assert time.monotonic() < deadline, f"fewer than {entries} entries written in {timeout} s"
        time.sleep(0.05)


def test_a_prefix_prefilled_by_one_server_is_loaded_by_another(tmp_path: Path) -> None:
    rng = random.Random(57)
    prompt = [rng.randrange(256) for _ in range(BLOCK * 7 + 5)]
    stored = (len(prompt) - 1) // BLOCK * BLOCK
    flags = ["--state-cache-dir", str(tmp_path), "--state-cache-block-tokens", str(BLOCK), *DETERMINISTIC]
    with running_server(flags) as a, running_server(flags) as b, a.client() as ca, b.client() as cb:
        first = ca.post("/generate", json=body(prompt, 8))
        assert first.status_code == 200, first.text
        wait_for_writes(a, stored // BLOCK + 1)  # its blocks and the state after them
        second = cb.post("/generate", json=body(prompt, 8))
        assert second.status_code == 200, second.text
        assert second.json()["output_ids"] == first.json()["output_ids"]
        assert second.json()["meta_info"]["cached_tokens"] == stored
        assert b.metric("hyssm_state_store_loads_total", result="loaded") == 1
        assert b.metric("hyssm_cache_hit_tokens_total", tier="store") == stored
        assert a.metric("hyssm_state_store_loads_total", result="started") == 0
