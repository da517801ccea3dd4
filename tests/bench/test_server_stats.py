"""benchmarks/server_stats.py: the server-side hit rate and per-replica request counts of a run."""

from __future__ import annotations

import asyncio
import math

import httpx

from benchmarks.server_stats import ServerCounters, counters_delta, prometheus_sum, read_counters, replica_requests
from tests.bench.fake_server import FakeServer

METRICS = """# TYPE hyssm_prefix_cache_hit_tokens_total counter
hyssm_prefix_cache_hit_tokens_total{kind="kv_only"} 5.0
hyssm_prefix_cache_hit_tokens_total{kind="state"} 120.0
hyssm_prefix_cache_queried_tokens_total 400.0
"""


def test_prometheus_sum_by_labels() -> None:
    assert prometheus_sum(METRICS, "hyssm_prefix_cache_hit_tokens_total", kind="state") == 120.0
    assert prometheus_sum(METRICS, "hyssm_prefix_cache_hit_tokens_total") == 125.0
    assert prometheus_sum(METRICS, "hyssm_prefix_cache_queried_tokens_total") == 400.0
    assert prometheus_sum(METRICS, "hyssm_absent_total") is None


def test_replica_requests_and_delta() -> None:
    info = {"replicas": [{"dp_rank": 0, "routed_requests": {"cache": 3, "load": 1, "balance": 0}},
                         {"dp_rank": 1, "routed_requests": {"cache": 0, "load": 2, "balance": 1}}]}
    assert replica_requests(info) == {"0": 4, "1": 3}
    assert replica_requests({"scheduler": {}}) == {} and replica_requests([]) == {}
    before = ServerCounters(100.0, 400.0, {"0": 4, "1": 3}, 10.0, 5.0)
    after = ServerCounters(250.0, 600.0, {"0": 10, "1": 7}, 30.0, 45.0)
    assert counters_delta(before, after) == {"server_prefix_hit_rate": 0.75, "replica_requests": {"0": 6, "1": 4},
                                             "server_spec_accept_length": 3.0}  # fmt: skip
    missing = counters_delta(ServerCounters(), ServerCounters())
    assert math.isnan(missing["server_prefix_hit_rate"]) and missing["replica_requests"] == {}
    assert math.isnan(missing["server_spec_accept_length"])


def test_read_counters_of_a_server_without_them(server: FakeServer) -> None:
    async def main() -> ServerCounters:
        async with httpx.AsyncClient(base_url=server.base_url) as client:
            return await read_counters(client)

    got = asyncio.run(main())
    assert got.hit_tokens is None and got.queried_tokens is None and got.replica_requests == {}
