"""Graceful shutdown and injected step errors (issue 7)."""

from __future__ import annotations

import concurrent.futures as cf
import signal
import time

import httpx
import pytest

from tests.e2e.server import Server, running_server, wait_group_empty

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def _gen(server: Server, n: int, stream: bool = False) -> httpx.Response:
    body = {"input_ids": [5, 6, 7, 8], "stream": stream,
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        return client.post("/generate", json=body)


def test_sigterm_answers_in_flight_requests_and_exits_zero() -> None:
    server = Server(["--fault-delay-step-s", "0.01"])
    try:
        server.wait_ready()
        with cf.ThreadPoolExecutor(8) as pool:
            short = [pool.submit(_gen, server, 5) for _ in range(4)]
            long = [pool.submit(_gen, server, 4000, True) for _ in range(4)]
            for f in short:
                assert f.result(60).status_code == 200
            t0 = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            code = server.wait_exit(20)
            elapsed = time.monotonic() - t0
            answers = [f.result(20) for f in long]
        assert code == 0, server.output[-3000:]
        assert elapsed < 15, elapsed
        for r in answers:  # each stream ended with a final event and [DONE]
            assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
        assert wait_group_empty(server.pgid) == []
    finally:
        server.kill_group()


def test_injected_step_error_fails_that_batch_and_serving_goes_on() -> None:
    with running_server(["--fault-raise-at-step", "3"]) as server:
        first = _gen(server, 20)
        assert first.status_code >= 500 or first.json()["meta_info"]["finish_reason"]["type"] == "abort", first.text
        assert "step 3" in first.text
        again = _gen(server, 6)
        assert again.status_code == 200 and len(again.json()["output_ids"]) == 6
        with server.client() as client:
            assert client.get("/health").status_code == 200


@pytest.mark.parametrize("process", ["scheduler", "worker-tp0"])
def test_injected_crash_ends_the_launch(process: str) -> None:
    server = Server(["--fault-crash-process", process, "--fault-crash-at-step", "4"])
    try:
        server.wait_ready()
        r = _gen(server, 50)
        assert r.status_code == 503 and "error" in r.json(), r.text
        assert server.wait_exit(20) != 0
        assert "exited unexpectedly" in server.output
        assert wait_group_empty(server.pgid) == []
    finally:
        server.kill_group()
