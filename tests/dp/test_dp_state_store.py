"""--dp-size 2 replicas with one state store: a prefix one replica prefilled is a load on the other
(after /flush_cache emptied both memory caches, the router sends the repeat to the replica that has
been sent fewer requests: the other one), with the same greedy tokens."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from tests.e2e.server import DETERMINISTIC, running_server
from tests.e2e.test_state_store_shared import body

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]

BLOCK = 32


def test_a_prefix_written_by_one_replica_is_loaded_by_the_other(tmp_path: Path) -> None:
    rng = random.Random(16)
    prompt = [rng.randrange(256) for _ in range(BLOCK * 6 + 3)]
    stored = (len(prompt) - 1) // BLOCK * BLOCK
    flags = ["--dp-size", "2", "--state-cache-dir", str(tmp_path), "--state-cache-block-tokens", str(BLOCK),
             *DETERMINISTIC]
    with running_server(flags) as server, server.client() as client:
        first = client.post("/generate", json=body(prompt, 8))
        assert first.status_code == 200, first.text

        def stores() -> list[dict]:
            replicas = client.get("/get_server_info").json()["replicas"]
            return [r["scheduler"]["server"]["state_store"] or {} for r in replicas]

        deadline = time.monotonic() + 60
        while max(s.get("entries_written", 0) for s in stores()) < stored // BLOCK + 1:
            assert time.monotonic() < deadline, stores()
            time.sleep(0.05)
        writer = max(range(2), key=lambda d: stores()[d].get("entries_written", 0))
        assert client.post("/flush_cache").status_code == 200
        second = client.post("/generate", json=body(prompt, 8))
        assert second.status_code == 200, second.text
        assert second.json()["output_ids"] == first.json()["output_ids"]
        assert second.json()["meta_info"]["cached_tokens"] == stored
        loaded = [s.get("entries_read", 0) for s in stores()]
        assert loaded[1 - writer] == stored // BLOCK + 1 and loaded[writer] == 0, (writer, stores())
