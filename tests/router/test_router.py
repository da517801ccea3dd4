"""hyssm servers (real launch.py processes, the built-in model) behind a real sglang-router with
its cache-aware policy (issue 16): the router registers them from their info endpoints, a
shared-prefix workload through it hits the prefix caches at least as often as on one server, the
openai SDK works through it, and a server killed mid-load answers every client within a bound
while the router serves later requests from the others."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import random
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.e2e.server import Server
from tests.router.router_proc import Router, require_router, running_router

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(240)]

BOUND_S = 30.0  # every client of a killed server has its answer (or error) within this
GENERATE = {"endpoint": "/generate", "status": "200"}


def shared_prefix_phases(seed: int, groups: int = 4, per_group: int = 6, prefix: int = 160,
                         suffix: int = 24) -> list[list[list[int]]]:  # fmt: skip
    """`groups` random prefixes, each followed by `per_group` distinct random suffixes, as phases
    sent one after the other, the requests of a phase at once: every group's first request, then
    every group's second, then the rest. (At once, so the router sees load and spreads the groups'
    first requests; in phases, so a hit never depends on how two requests of a group overlap.)"""
    rng = random.Random(seed)
    heads = [[rng.randrange(3, 256) for _ in range(prefix)] for _ in range(groups)]
    rows = [[h + [rng.randrange(3, 256) for _ in range(suffix)] for _ in range(per_group)] for h in heads]
    return [[r[0] for r in rows], [r[1] for r in rows], [p for r in rows for p in r[2:]]]


def _generate(url: str, ids: list[int]) -> tuple[int, int]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/generate", json=body)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    return meta["cached_tokens"], meta["prompt_tokens"]


def run_phases(url: str, phases: list[list[list[int]]]) -> tuple[int, int]:
    """Send each phase's prompts at once to /generate, phase after phase; (sum of cached_tokens,
    sum of prompt_tokens)."""
    cached = total = 0
    with cf.ThreadPoolExecutor(max(len(p) for p in phases)) as pool:
        for phase in phases:
            for c, t in pool.map(lambda ids: _generate(url, ids), phase):
                cached, total = cached + c, total + t
    return cached, total


def start_servers(n: int, extra: list[str] | None = None) -> list[Server]:
    servers = [Server(["--max-running-requests", "16", *(extra or [])]) for _ in range(n)]
    try:
        for s in servers:
            s.wait_ready()
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[Server], Router]]:
    """Two servers and a cache-aware router in front of them, for the module."""
    require_router()
    servers = start_servers(2)
    try:
        log = str(tmp_path_factory.mktemp("router") / "router.log")
        with running_router([s.url for s in servers], log) as router:
            yield servers, router
    finally:
        for s in servers:
            s.stop()


def test_router_registers_hyssm_from_its_info_endpoints(pair: tuple[list[Server], Router]) -> None:
    servers, router = pair
    with httpx.Client(base_url=router.url, timeout=30) as c:
        models = c.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["hyssm-tiny"]
        doc = c.get("/workers").json()
        meta = {w["url"]: w.get("metadata", {}) for w in doc["workers"]}
        for s in servers:
            assert meta[s.url]["served_model_name"] == "hyssm-tiny"
            assert meta[s.url]["architectures"] == '["GraniteMoeHybridForCausalLM"]'
        loads = c.get("/get_loads").json()["workers"]
        assert sorted(w["worker"] for w in loads) == sorted(s.url for s in servers)
        assert all(w["load"] >= 0 for w in loads), loads  # -1: the router could not read /get_load
    assert "returned 404" not in router.output  # no endpoint it asked for was missing


def test_shared_prefix_hit_rate_through_the_router_at_least_one_servers(pair: tuple[list[Server], Router]) -> None:
    """Same workload: first straight to one server, then (caches flushed through the router's
    fan-out) through the router to both. The cache-aware router keeps each prefix group on one
    server, so the hit rate is at least the single server's; both servers serve."""
    servers, router = pair
    phases = shared_prefix_phases(seed=3)
    n = sum(len(p) for p in phases)
    cached1, total1 = run_phases(servers[0].url, phases)
    with httpx.Client(base_url=router.url, timeout=30) as c:
        r = c.post("/flush_cache")
        assert r.status_code == 200 and r.json()["workers_flushed"] == 2, r.text
    before = [s.metric("hyssm_http_requests_total", **GENERATE) for s in servers]
    cached2, total2 = run_phases(router.url, phases)
    served = [s.metric("hyssm_http_requests_total", **GENERATE) - b for s, b in zip(servers, before, strict=True)]
    assert total1 == total2 == sum(len(ids) for p in phases for ids in p)
    single, routed = cached1 / total1, cached2 / total2
    assert single > 0.4, single  # the workload does hit on one server
    assert routed >= single, (routed, single, served)
    assert sum(served) == n and min(served) > 0, served


def test_openai_client_through_the_router(pair: tuple[list[Server], Router]) -> None:
    _, router = pair
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list()] == ["hyssm-tiny"]
    chat = client.chat.completions.create(model="hyssm-tiny", messages=[{"role": "user", "content": "Hello"}],
                                          max_tokens=5, temperature=0)  # fmt: skip
    assert chat.choices[0].message.content and chat.usage is not None and chat.usage.completion_tokens == 5
    comp = client.completions.create(model="hyssm-tiny", prompt="Once upon a time", max_tokens=4, temperature=0)
    assert comp.choices[0].finish_reason == "length" and comp.usage is not None and comp.usage.completion_tokens == 4
    pieces = [ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model="hyssm-tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=5, temperature=0, stream=True,
    ) if ch.choices]  # fmt: skip
    assert "".join(pieces) == chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError):  # a hyssm 400 comes back through the router
        client.completions.create(model="hyssm-tiny", prompt="x", max_tokens=4, extra_body={"suffix": "y"})


class Client:
    """One long request through the router in a thread; records how it ended and when."""

    def __init__(self, url: str, stream: bool, started: threading.Semaphore, seed: int) -> None:
        self.url, self.stream, self.started = url, stream, started
        self.ids = [random.Random(seed).randrange(3, 256) for _ in range(20)]
        self.outcome = ""
        self.ended_at = 0.0

    def __call__(self) -> None:
        body = {"input_ids": self.ids, "stream": self.stream,
                "sampling_params": {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True}}  # fmt: skip
        try:
            with httpx.Client(base_url=self.url, timeout=BOUND_S * 2) as c:
                if self.stream:
                    with c.stream("POST", "/generate", json=body) as r:
                        self.outcome = f"stream-{r.status_code}"
                        for line in r.iter_lines():
                            if line.startswith("data: {") and self.outcome == "stream-200":
                                self.outcome = "streaming"
                                self.started.release()
                            if line == "data: [DONE]":
                                self.outcome += "-done"
                else:
                    self.started.release()
                    r = c.post("/generate", json=body)
                    self.outcome = f"http-{r.status_code}"
        except httpx.HTTPError as e:
            self.outcome += f"-closed:{type(e).__name__}"
        self.ended_at = time.monotonic()


def test_server_killed_mid_load(tmp_path) -> None:
    """Kill one of two servers (SIGKILL to its whole launch) while requests stream through the
    router: every client ends within BOUND_S, the router marks it unhealthy, and later requests
    are all served by the survivor."""
    require_router()
    servers = start_servers(2, ["--fault-delay-step-s", "0.02"])
    victim, survivor = servers
    try:
        with running_router([s.url for s in servers], str(tmp_path / "router.log")) as router:
            started = threading.Semaphore(0)
            clients = [Client(router.url, stream=i % 2 == 0, started=started, seed=i) for i in range(10)]
            with cf.ThreadPoolExecutor(len(clients)) as pool:
                futures = [pool.submit(c) for c in clients]
                for _ in clients:
                    assert started.acquire(timeout=60), [c.outcome for c in clients]
                deadline = time.monotonic() + 30
                while victim.metric("hyssm_http_in_flight_requests") < 1 and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert victim.metric("hyssm_http_in_flight_requests") >= 1, "the victim got no request"
                os.killpg(victim.pgid, signal.SIGKILL)
                t_kill = time.monotonic()
                cf.wait(futures, timeout=BOUND_S + 30)
            for c in clients:
                assert c.ended_at and c.ended_at - t_kill <= BOUND_S, (c.outcome, router.output[-3000:])
            assert any(c.outcome in ("http-200", "streaming-done") for c in clients)  # the survivor's finish
            router.wait_workers({victim.url: False, survivor.url: True}, timeout=30)
            before = survivor.metric("hyssm_http_requests_total", **GENERATE)
            later = shared_prefix_phases(seed=9, groups=2, per_group=4)
            run_phases(router.url, later)
            assert survivor.metric("hyssm_http_requests_total", **GENERATE) - before == 8
    finally:
        for s in servers:
            s.stop()


@pytest.mark.parametrize("flags", [["--backend", "hyssm"], ["--backend", "openai", "--prompt-format", "text"]])
def test_bench_serving_through_the_router(pair: tuple[list[Server], Router], tmp_path, flags: list[str]) -> None:
    """benchmarks/bench_serving.py targets the router like a server: every request completes and
    the prefix-cache hit rate (the workers' cached_tokens passed through) is reported."""
    from benchmarks.bench_serving import main

    _, router = pair
    out = tmp_path / "bench.json"
    rc = main(["--base-url", router.url, *flags, "--num-prompts", "12", "--concurrency", "4", "--shared-prefix-len",
               "120", "--num-prefix-groups", "2", "--input-len", "16", "--output-len", "4", "--flush-cache",
               "--vocab-size", "256", "--disable-tqdm", "--output-json", str(out)])  # fmt: skip
    m = json.loads(out.read_text())
    assert rc == 0 and (m["completed"], m["failed"]) == (12, 0), m["errors"]
    assert m["total_input_tokens"] == 12 * 136 and m["total_output_tokens"] == 12 * 4
    assert 0 < m["prefix_cache_hit_rate"] < 1 and m["total_cached_tokens"] > 0
