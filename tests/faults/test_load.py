"""Load with faults (issue 7): injected copy-on-write refusals change nothing in the outputs, and
clients that disconnect at random leave no slot or lock behind."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from shared.config import builtin_model_dir
from tests.e2e.server import DETERMINISTIC, Server, running_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]


def shared_prefix_prompts(n: int, seed: int, groups: int = 4, prefix_len: int = 48) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(256) for _ in range(prefix_len)] for _ in range(groups)]
    return [prefixes[i % groups] + [rng.randrange(256) for _ in range(rng.randint(1, 24))] for i in range(n)]


async def _one(client: httpx.AsyncClient, ids: list[int], n: int) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    r = await client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def _all(server: Server, prompts: list[list[int]], n: int) -> list[dict]:
    limits = httpx.Limits(max_connections=len(prompts))
    async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as client:
        return await asyncio.gather(*(_one(client, p, n) for p in prompts))


def wait_drained(server: Server, timeout: float = 30.0) -> dict:
    """Poll /get_server_info until no request holds a slot; return that document's 'scheduler' part."""
    deadline = time.monotonic() + timeout
    with server.client() as client:
        while True:
            info = client.get("/get_server_info").json()
            sched = info.get("scheduler", info)
            server_part = sched.get("server", sched)
            if server_part["num_running"] == 0 and server_part["num_waiting"] == 0:
                if server_part["kv_used_by_requests"] == 0 and server_part["state_used_by_requests"] == 0:
                    return server_part
            assert time.monotonic() < deadline, server_part
            time.sleep(0.1)


def test_cow_refusals_change_nothing() -> None:
    from tests.model_driver import generate_greedy
    from worker_proc.runtime.config import WorkerConfig
    from worker_proc.runtime.runner import ModelRunner

    prompts = shared_prefix_prompts(200, seed=3)
    runner = ModelRunner(
        builtin_model_dir(),
        WorkerConfig(device="cpu", dtype="float32", kv_slots=1024, state_slots=4, deterministic=True),
    )
    expected = [generate_greedy(runner, p, 6) for p in prompts]
    args = ["--fault-refuse-cow-fraction", "0.3", "--max-running-requests", "32", *DETERMINISTIC]
    with running_server(args) as server:
        results = asyncio.run(_all(server, prompts, 6))
        assert [r["output_ids"] for r in results] == expected
        with server.client() as client:
            metrics = client.get("/metrics").text
        refusals = [ln for ln in metrics.splitlines() if ln.startswith("hyssm_") and "worker_refusal" in ln]
        assert refusals and any(float(ln.rsplit(" ", 1)[1]) > 0 for ln in refusals), metrics
        left = wait_drained(server)
        assert left["num_locked_nodes"] == 0


async def _maybe_disconnect(client: httpx.AsyncClient, ids: list[int], rng: random.Random) -> str:
    body = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": rng.randint(4, 40), "temperature": 0, "ignore_eos": True},
    }
    cut_after = rng.randint(0, 6) if rng.random() < 0.2 else None
    if cut_after == 0:  # disconnect before any token arrives
        task = asyncio.ensure_future(client.post("/generate", json=body))
        await asyncio.sleep(rng.random() * 0.05)
        task.cancel()
        return "cut"
    seen = 0
    async with client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                seen += 1
                if cut_after is not None and seen >= cut_after:
                    return "cut"
                if line == "data: [DONE]":
                    return "done"
    return "closed"


def test_500_clients_with_random_disconnects_leave_nothing_behind() -> None:
    rng = random.Random(11)
    prompts = shared_prefix_prompts(500, seed=5, groups=8)
    # a queue that holds every client: this is about disconnects, not backpressure (test_backpressure.py)
    args = ["--max-total-tokens", "1200", "--max-mamba-cache-size", "24", "--max-running-requests", "16",
            "--max-queued-requests", "600"]  # fmt: skip
    with running_server(args) as server:

        async def main() -> list[str]:
            limits = httpx.Limits(max_connections=500)
            async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as client:
                return await asyncio.gather(*(_maybe_disconnect(client, p, rng) for p in prompts))

        outcomes = asyncio.run(main())
        assert outcomes.count("closed") == 0
        assert outcomes.count("done") >= 350
        left = wait_drained(server, timeout=60)
        assert left["num_locked_nodes"] == 0
        with server.client() as client:
            ok = client.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
            assert ok.status_code == 200
