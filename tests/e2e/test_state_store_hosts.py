"""One state store, two hosts: servers in network namespaces A (10.77.0.1) and B (10.77.0.2), joined by
a veth pair, share a store folder (as servers on a shared filesystem do); a prefix prefilled on A is
a load on B, which never saw it, with the same greedy tokens. Root only (skipped otherwise)."""

from __future__ import annotations

import concurrent.futures as cf
import random
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import DETERMINISTIC, Server
from tests.e2e.test_state_store_shared import body, wait_for_writes
from tests.tp.netns import HostPair, enter
from tests.tp.test_tp_netns import hosts  # noqa: F401 - the fixture: two namespaces joined by a veth pair

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

BLOCK = 32


def generate_in(ns: str, server: Server, prompt: list[int]) -> dict:
    """A /generate from a thread inside `ns` (where the server's 127.0.0.1 is)."""
    def call() -> dict:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            r = client.post("/generate", json=body(prompt, 8))
        assert r.status_code == 200, r.text
        return r.json()

    with cf.ThreadPoolExecutor(1, initializer=enter, initargs=(ns,)) as pool:
        return pool.submit(call).result()


def metric_in(ns: str, server: Server, name: str, **labels: str) -> float:
    with cf.ThreadPoolExecutor(1, initializer=enter, initargs=(ns,)) as pool:
        return pool.submit(server.metric, name, **labels).result()


def test_a_prefix_prefilled_on_one_host_is_loaded_on_the_other(hosts: HostPair, tmp_path: Path) -> None:  # noqa: F811
    rng = random.Random(3)
    prompt = [rng.randrange(256) for _ in range(BLOCK * 5 + 7)]
    stored = (len(prompt) - 1) // BLOCK * BLOCK
    flags = ["--state-cache-dir", str(tmp_path), "--state-cache-block-tokens", str(BLOCK), *DETERMINISTIC]
    a = Server(flags, prefix=hosts.exec_prefix(hosts.ns_a))
    b = Server(flags, prefix=hosts.exec_prefix(hosts.ns_b))
    try:
        a.wait_ready()
        b.wait_ready()
        first = generate_in(hosts.ns_a, a, prompt)
        with cf.ThreadPoolExecutor(1, initializer=enter, initargs=(hosts.ns_a,)) as pool:
            pool.submit(wait_for_writes, a, stored // BLOCK + 1).result()
        second = generate_in(hosts.ns_b, b, prompt)
        assert second["output_ids"] == first["output_ids"]
        assert second["meta_info"]["cached_tokens"] == stored
        assert metric_in(hosts.ns_b, b, "hyssm_state_store_loads_total", result="loaded") == 1
    finally:
        a.stop()
        b.stop()
    assert hosts.pids(hosts.ns_a) == [] and hosts.pids(hosts.ns_b) == []
