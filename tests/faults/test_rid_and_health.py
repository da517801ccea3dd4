"""Rid reuse and /health against a real server (issue 17, defects 2 and 7)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.server import Server, running_server
from tests.faults.test_process_death import find_process
from tokenizer_proc.api.health import HEALTH_TIMEOUT_S

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with running_server(["--fault-delay-step-s", "0.005", "--max-running-requests", "16"]) as srv:
        yield srv


class Load:
    """Streaming requests kept running in the background, so that batches are always in flight."""

    def __init__(self, server: Server, n: int) -> None:
        self.server, self.stop = server, threading.Event()
        self.pool = cf.ThreadPoolExecutor(n)
        self.started = threading.Semaphore(0)
        self.futures = [self.pool.submit(self._run) for _ in range(n)]
        for _ in range(n):
            assert self.started.acquire(timeout=60)

    def _run(self) -> int:
        body = {"input_ids": PROMPT, "stream": True,
                "sampling_params": {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}}  # fmt: skip
        with httpx.Client(base_url=self.server.url, timeout=60) as client:
            with client.stream("POST", "/generate", json=body) as r:
                for i, _ in enumerate(r.iter_lines()):
                    if i == 0:
                        self.started.release()
                    if self.stop.is_set():
                        return r.status_code
        return r.status_code

    def close(self) -> None:
        self.stop.set()
        for f in self.futures:
            assert f.result(60) == 200
        self.pool.shutdown()


def test_rid_reused_right_after_a_stop_string_finish(server: Server) -> None:
    """The stop string is matched in the tokenizer, which aborts the request at the scheduler
    while its next step is in flight; the same rid sent at once is a new request (it used to get
    503 "duplicate request id"), and it gets its own output, not the old one's abort."""
    with server.client() as client:
        whole = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {
            "max_new_tokens": 40, "temperature": 0, "ignore_eos": True}}).json()["text"]  # fmt: skip
        stop = next(whole[i : i + 2] for i in range(8, len(whole)) if whole[i : i + 2].strip())
        expected = whole[: whole.index(stop)]
        load = Load(server, 4)
        try:
            for i in range(40):
                body = {"input_ids": PROMPT, "rid": "reused",
                        "sampling_params": {"max_new_tokens": 40, "temperature": 0, "stop": [stop]}}  # fmt: skip
                r = client.post("/generate", json=body)
                assert r.status_code == 200, (i, r.text)
                out = r.json()
                assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}, (i, out)
                assert out["text"] == expected and out["meta_info"]["id"] == "reused", (i, out)
        finally:
            load.close()


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_concurrent_requests_sharing_a_rid_get_400(server: Server, stream: bool) -> None:
    """Of ten requests sent at once with one rid, one runs; the nine others get a plain 400 (they
    used to get a 200 stream with an error event when they passed the check together)."""
    n = 10
    gate = threading.Barrier(n)

    def send(_: int) -> tuple[int, str]:
        body = {"input_ids": PROMPT, "rid": "twin", "stream": stream,
                "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}}  # fmt: skip
        with httpx.Client(base_url=server.url, timeout=60) as client:
            gate.wait(30)
            r = client.post("/generate", json=body)
            return r.status_code, r.text

    with cf.ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(send, range(n)))
    ok = [text for status, text in answers if status == 200]
    rejected = [json.loads(text)["error"] for status, text in answers if status == 400]
    assert len(ok) == 1 and len(rejected) == n - 1, [a[0] for a in answers]
    assert '"error"' not in ok[0]
    assert all(e["param"] == "rid" and "twin" in e["message"] for e in rejected), rejected


def test_health_stays_quick_under_load(server: Server) -> None:
    load = Load(server, 6)
    try:
        with server.client() as client:
            for _ in range(5):
                t0 = time.monotonic()
                assert client.get("/health").status_code == 200
                assert time.monotonic() - t0 < 2.0
    finally:
        load.close()


@pytest.mark.slow
@pytest.mark.parametrize("title", ["hyssm::scheduler", "hyssm::worker-tp0"])
def test_health_is_503_while_a_process_is_stopped(server: Server, title: str) -> None:
    pid = find_process(server, title)
    with server.client(timeout=HEALTH_TIMEOUT_S + 10) as client:
        assert client.get("/health").status_code == 200
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            r = client.get("/health")
            assert r.status_code == 503 and "within" in r.json()["error"]["message"], r.text
            assert time.monotonic() - t0 < HEALTH_TIMEOUT_S + 3
        finally:
            os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "not healthy again after SIGCONT"
        r = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}})
        assert r.status_code == 200


def test_health_is_not_200_before_the_pipeline_is_ready() -> None:
    """/health used to answer 200 as soon as the HTTP server listened, before the worker was
    ready; now its first 200 comes when the scheduler loop already serves."""
    server = Server([])
    try:
        seen_503 = False
        deadline = time.monotonic() + 120
        with httpx.Client(base_url=server.url, timeout=HEALTH_TIMEOUT_S + 10) as client:
            while True:
                assert time.monotonic() < deadline and server.proc.poll() is None, server.output[-3000:]
                try:
                    r = client.get("/health")
                except httpx.TransportError:  # not listening yet
                    time.sleep(0.05)  # poll interval for an outside process, not synchronisation
                    continue
                if r.status_code == 200:
                    break
                assert r.status_code == 503 and r.headers["content-type"] == "application/json"
                seen_503 = True
            info = client.get("/get_server_info", timeout=2.0)
            assert info.status_code == 200 and info.json()["scheduler"], info.text
        server.wait_ready(60)
        assert seen_503 or "hyssm: serving" in server.output
    finally:
        server.stop()
