"""Backpressure (issue 28): past --max-running-requests + --max-queued-requests a new generation
request gets 503 with Retry-After and a JSON body before its response starts (streamed or not);
the openai SDK's own retry backs off on it and succeeds once the queue drains; sglang-router in
front gets the 503 instead of hanging; /get_load and /metrics show the queue and the refusals."""

from __future__ import annotations

import concurrent.futures as cf
import tempfile
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.e2e.server import Server, running_server
from tests.router.router_proc import require_router, running_router

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

RUNNING, QUEUED = 2, 1
BODY = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    flags = ["--max-running-requests", str(RUNNING), "--max-queued-requests", str(QUEUED),
             "--fault-delay-step-s", "0.02"]  # fmt: skip
    with running_server(flags) as srv:
        yield srv


class Fill:
    """RUNNING + QUEUED streamed generations of `tokens` each, in threads: the server is full until
    they end (or `close` drops them)."""

    def __init__(self, server: Server, tokens: int) -> None:
        self.server, self.stop = server, threading.Event()
        body = {"input_ids": [9, 8, 7, 6], "stream": True,
                "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}  # fmt: skip
        self.pool = cf.ThreadPoolExecutor(RUNNING + QUEUED)
        self.futures = [self.pool.submit(self._run, body) for _ in range(RUNNING + QUEUED)]
        deadline = time.monotonic() + 60
        while load(server)["num_queued_reqs"] < QUEUED:  # every one of them is admitted
            assert time.monotonic() < deadline, load(server)
            time.sleep(0.05)  # polling another process's state, not synchronisation

    def _run(self, body: dict) -> int:
        with httpx.Client(base_url=self.server.url, timeout=120) as client:
            with client.stream("POST", "/generate", json=body) as r:
                for _ in r.iter_lines():
                    if self.stop.is_set():
                        break
                return r.status_code

    def close(self) -> None:
        self.stop.set()
        assert [f.result(120) for f in self.futures] == [200] * (RUNNING + QUEUED)
        self.pool.shutdown()


def load(server: Server) -> dict:
    with server.client() as client:
        entries = client.get("/get_load").json()
    assert len(entries) == 1
    return entries[0]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_full_queue_is_503_with_retry_after_before_the_response(server: Server, stream: bool) -> None:
    fill = Fill(server, 2000)
    try:
        refused_before = server.metric("hyssm_http_refused_requests_total", reason="queue_full")
        with server.client() as client:
            r = client.post("/generate", json={**BODY, "stream": stream})
        assert r.status_code == 503 and r.headers["content-type"] == "application/json", r.text
        assert r.headers["retry-after"] == "1"
        err = r.json()["error"]
        assert err["code"] == 503 and "--max-queued-requests" in err["message"], err
        entry = load(server)
        assert entry["num_queued_reqs"] == QUEUED and entry["max_queued_reqs"] == QUEUED, entry
        assert entry["num_refused_reqs"] >= 1
        assert server.metric("hyssm_http_refused_requests_total", reason="queue_full") == refused_before + 1
        assert server.metric("hyssm_http_queued_requests") == QUEUED
    finally:
        fill.close()


def test_openai_client_backs_off_and_succeeds_once_the_queue_drains(server: Server) -> None:
    statuses: list[int] = []
    http = httpx.Client(event_hooks={"response": [lambda r: statuses.append(r.status_code)]}, timeout=60)
    # each retry waits the Retry-After second: 60 of them outlast the fill on a loaded machine
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=60, http_client=http)
    fill = Fill(server, 120)
    try:
        done = client.completions.create(model="hyssm-tiny", prompt=[5, 6, 7], max_tokens=2)
    finally:
        fill.close()
        http.close()
    assert done.choices[0].finish_reason == "length"
    assert statuses[0] == 503 and statuses[-1] == 200 and set(statuses[:-1]) == {503}, statuses
    assert len(statuses) >= 2


def test_sglang_router_gets_the_503_instead_of_hanging(server: Server) -> None:
    require_router()
    with tempfile.NamedTemporaryFile(prefix="router-", suffix=".log") as log:
        with running_router([server.url], log.name) as router:
            fill = Fill(server, 4000)
            try:
                t0 = time.monotonic()
                with httpx.Client(timeout=60) as client:
                    r = client.post(router.url + "/generate", json=BODY)
                took = time.monotonic() - t0
            finally:
                fill.close()
            assert r.status_code == 503, (r.status_code, r.text, router.output[-2000:])
            assert took < 30, took
