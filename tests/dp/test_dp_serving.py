"""--dp-size 2 through a real launch.py on CPU (issue 16): prefix hits on a shared-prefix load, outputs
equal to one replica, both replicas used under load, counters summed over replicas."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from tests.e2e.server import DETERMINISTIC, Server, running_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

CHUNK = 64
FLAGS = ["--chunked-prefill-size", str(CHUNK), "--random-seed", "0", *DETERMINISTIC]
SYSTEM_LEN = 300


def shared_prefix_prompts(seed: int, groups: int, per_group: int, suffix: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(256) for _ in range(SYSTEM_LEN)] for _ in range(groups)]
    return [prefixes[i % groups] + [rng.randrange(256) for _ in range(suffix)] for i in range(groups * per_group)]


def body(ids: list[int], n: int) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}


def sequential(server: Server, prompts: list[list[int]], n: int) -> list[dict]:
    with server.client() as client:
        out = []
        for ids in prompts:
            r = client.post("/generate", json=body(ids, n))
            assert r.status_code == 200, r.text
            out.append(r.json())
        return out


async def _concurrent(server: Server, prompts: list[list[int]], n: int, limit: int) -> list[dict]:
    sem = asyncio.Semaphore(limit)
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:

        async def one(ids: list[int]) -> dict:
            async with sem:
                r = await client.post("/generate", json=body(ids, n))
            assert r.status_code == 200, r.text
            return r.json()

        return list(await asyncio.gather(*(one(p) for p in prompts)))


def concurrent(server: Server, prompts: list[list[int]], n: int, limit: int = 6) -> list[dict]:
    """The prompts with at most `limit` in flight (later ones arrive once earlier ones are cached)."""
    return asyncio.run(_concurrent(server, prompts, n, limit))


def server_info(server: Server) -> dict:
    with server.client() as client:
        r = client.get("/get_server_info")
        assert r.status_code == 200, r.text
        return r.json()


def replica_metric(replica: dict, name: str, **labels: str) -> float:
    recs = [m for m in replica["scheduler"]["metrics"] if m["name"] == name]
    return sum(m["value"] for m in recs if all(m["labels"].get(k) == v for k, v in labels.items()))


@pytest.fixture(scope="module")
def dp1() -> Server:
    with running_server(FLAGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def dp2() -> Server:
    with running_server(["--dp-size", "2", *FLAGS]) as srv:
        yield srv


def test_shared_prefix_hits_and_equals_one_replica(dp1: Server, dp2: Server) -> None:
    prompts = shared_prefix_prompts(seed=1, groups=1, per_group=12)
    one = sequential(dp1, prompts, 8)
    two = sequential(dp2, prompts, 8)
    assert [r["output_ids"] for r in two] == [r["output_ids"] for r in one]
    for i, res in enumerate(two):
        if i >= 2:  # the second request saves the state at the branch point; the third resumes from it
            assert res["meta_info"]["cached_tokens"] >= SYSTEM_LEN - CHUNK, (i, res["meta_info"])
    info = server_info(dp2)
    assert info["dp_size"] == 2 and [r["up"] for r in info["replicas"]] == [True, True]
    # one prefix, one at a time: every request after the first follows the prefix to its replica
    cache_routed = sum(r["routed_requests"]["cache"] for r in info["replicas"])
    assert cache_routed >= len(prompts) - 1, info["replicas"]


def test_under_load_both_replicas_work_and_counters_sum(dp1: Server, dp2: Server) -> None:
    before = server_info(dp2)
    hits_before = dp2.metric("hyssm_prefix_cache_hit_tokens_total", kind="state")
    queried_before = dp2.metric("hyssm_prefix_cache_queried_tokens_total")
    prompts = shared_prefix_prompts(seed=2, groups=2, per_group=12)
    one = concurrent(dp1, prompts, 16)
    two = concurrent(dp2, prompts, 16)
    assert [r["output_ids"] for r in two] == [r["output_ids"] for r in one]
    info = server_info(dp2)
    for d in (0, 1):
        admitted = replica_metric(info["replicas"][d], "hyssm_admitted_requests_total")
        assert admitted > replica_metric(before["replicas"][d], "hyssm_admitted_requests_total"), (d, info["replicas"])
    cached = sum(r["meta_info"]["cached_tokens"] for r in two)
    assert cached > 0
    # cached_tokens in the responses are exactly the summed replicas' state hits; /metrics sums the replicas
    assert dp2.metric("hyssm_prefix_cache_hit_tokens_total", kind="state") - hits_before == cached
    assert dp2.metric("hyssm_prefix_cache_queried_tokens_total") - queried_before == sum(
        r["meta_info"]["prompt_tokens"] for r in two)
    per_replica = sum(replica_metric(r, "hyssm_prefix_cache_hit_tokens_total", kind="state") for r in info["replicas"])
    assert info["scheduler"]["server"]["prefix_state_hit_tokens"] == per_replica
    assert info["scheduler"]["server"]["kv_capacity"] == sum(
        r["scheduler"]["server"]["kv_capacity"] for r in info["replicas"])
    with dp2.client() as client:
        health = client.get("/health")
    assert health.status_code == 200 and health.json() == {
        "status": "ok", "degraded": False, "replicas_up": 2, "dp_size": 2}


def test_replicas_with_tensor_parallel_ranks(dp1: Server) -> None:
    """Each replica is a scheduler with its own TP ranks (and rendezvous port): outputs equal one rank."""
    prompts = shared_prefix_prompts(seed=3, groups=2, per_group=3)
    one = concurrent(dp1, prompts, 8, limit=2)
    with running_server(["--dp-size", "2", "--tp-size", "2", *FLAGS]) as dp2tp2:
        two = concurrent(dp2tp2, prompts, 8, limit=2)
        info = server_info(dp2tp2)
    assert [r["output_ids"] for r in two] == [r["output_ids"] for r in one]
    assert all(sum(r["routed_requests"].values()) > 0 for r in info["replicas"]), info["replicas"]
    assert sum(r["meta_info"]["cached_tokens"] for r in two) > 0
