"""The state store on Mooncake Store through real servers: a master and a standalone client hold the
entries, a restarted server loads a prefix the first one prefilled, with the same greedy tokens as a
server without a store (issue 57 acceptance: the prefix came back from Mooncake)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.e2e.server import DETERMINISTIC, running_server
from tests.e2e.test_state_store_shared import body, wait_for_writes
from tests.state_store.mooncake_service import mooncake_service

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

BLOCK = 32


def test_a_restarted_server_loads_its_prefix_from_mooncake(tmp_path: Path) -> None:
    rng = random.Random(11)
    prompt = [rng.randrange(256) for _ in range(BLOCK * 6 + 9)]
    stored = (len(prompt) - 1) // BLOCK * BLOCK
    with running_server(DETERMINISTIC) as plain, plain.client() as client:
        reference = client.post("/generate", json=body(prompt, 10)).json()["output_ids"]
    with mooncake_service(tmp_path) as service:
        extra = json.dumps({"master_server_address": service.master_address})
        flags = ["--hicache-storage-backend", "mooncake", "--hicache-storage-backend-extra-config", extra,
                 "--state-cache-block-tokens", str(BLOCK), *DETERMINISTIC]
        with running_server(flags) as first, first.client() as client:
            out = client.post("/generate", json=body(prompt, 10))
            assert out.status_code == 200, out.text
            assert out.json()["output_ids"] == reference
            wait_for_writes(first, stored // BLOCK + 1)
        with running_server(flags) as second, second.client() as client:
            out = client.post("/generate", json=body(prompt, 10))
            assert out.status_code == 200, out.text
            assert out.json()["output_ids"] == reference
            assert out.json()["meta_info"]["cached_tokens"] == stored
            assert second.metric("hyssm_state_store_loads_total", result="loaded") == 1


def test_an_unreachable_master_is_a_clear_start_up_error(tmp_path: Path) -> None:
    from tests.e2e.server import Server

    pytest.importorskip("mooncake.store", reason="Mooncake is not installed")
    extra = json.dumps({"master_server_address": "127.0.0.1:9"})
    server = Server(["--hicache-storage-backend", "mooncake", "--hicache-storage-backend-extra-config", extra])
    try:
        assert server.wait_exit(120) != 0
        assert "state store (mooncake" in server.output
    finally:
        server.stop()
