"""SIGTERM drain (issue 28): in-flight requests finish within --graceful-shutdown-timeout while new
ones get 503 and /health reports draining, then every process exits 0; a second SIGTERM ends the
launch at once. And /health never answers 200 once the watchdog has declared the engine dead."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.e2e.server import Server, group_pids, wait_group_empty
from tests.faults.test_process_death import find_process

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

TOKENS = 150


def _stream(server: Server, n: int, started: threading.Event) -> list[str]:
    """The data lines of one streamed /generate of `n` tokens; sets `started` at its first event."""
    body = {"input_ids": [5, 6, 7, 8], "stream": True,
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    lines: list[str] = []
    with httpx.Client(base_url=server.url, timeout=120) as client:
        with client.stream("POST", "/generate", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    started.set()
    return lines


def _wait_draining(server: Server, client: httpx.Client) -> httpx.Response:
    deadline = time.monotonic() + 20
    while (r := client.get("/health")).status_code == 200:
        assert time.monotonic() < deadline and server.proc.poll() is None, server.output[-3000:]
        time.sleep(0.05)  # polling another process, not synchronisation
    return r


def test_sigterm_drains_in_flight_requests_then_exits_zero() -> None:
    server = Server(["--fault-delay-step-s", "0.02", "--graceful-shutdown-timeout", "120"])
    try:
        server.wait_ready()
        started = threading.Event()
        with cf.ThreadPoolExecutor(1) as pool, server.client(timeout=30) as client:
            stream = pool.submit(_stream, server, TOKENS, started)
            assert started.wait(60), server.output[-3000:]
            server.proc.send_signal(signal.SIGTERM)
            health = _wait_draining(server, client)
            assert health.status_code == 503 and health.json()["status"] == "draining", health.text
            r = client.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
            assert r.status_code == 503 and r.headers["content-type"] == "application/json", r.text
            assert "shutting down" in r.json()["error"]["message"] and r.headers["retry-after"]
            assert not stream.done()  # the drain is still waiting for it
            lines = stream.result(120)
        code = server.wait_exit(30)
        assert code == 0, server.output[-3000:]
        events = [json.loads(ln[6:]) for ln in lines[:-1]]
        assert lines[-1] == "data: [DONE]" and all("error" not in e for e in events), lines[-3:]
        assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
        assert events[-1]["meta_info"]["completion_tokens"] == TOKENS
        assert "exited unexpectedly" not in server.output
        assert wait_group_empty(server.pgid) == []
    finally:
        server.kill_group()


def test_second_sigterm_stops_at_once() -> None:
    server = Server(["--fault-delay-step-s", "0.02", "--graceful-shutdown-timeout", "120"])
    try:
        server.wait_ready()
        started = threading.Event()
        with cf.ThreadPoolExecutor(1) as pool, server.client(timeout=30) as client:
            stream = pool.submit(_stream, server, 4000, started)
            assert started.wait(60), server.output[-3000:]
            server.proc.send_signal(signal.SIGTERM)
            _wait_draining(server, client)
            t0 = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            code = server.wait_exit(15)
            took = time.monotonic() - t0
            with pytest.raises(httpx.HTTPError):  # the stream was cut: its server is gone
                stream.result(30)
        assert code == 1 and took < 10, (code, took, server.output[-3000:])
        assert "received SIGTERM again" in server.output
        assert wait_group_empty(server.pgid) == []
    finally:
        server.kill_group()


def test_health_is_never_200_once_the_watchdog_fired() -> None:
    """SIGSTOP the worker; /health is polled every 0.6 s by overlapping checks. A probe in flight
    when the watchdog failed every request used to answer 200 ({"status": "ok"})."""
    server = Server(["--watchdog-timeout", "6"])
    answers: list[tuple[float, int]] = []
    try:
        server.wait_ready()
        with server.client(timeout=5) as client:
            assert client.get("/health").status_code == 200
        worker = find_process(server, "hyssm::worker-tp0")
        os.kill(worker, signal.SIGSTOP)
        stopped_at = time.monotonic()

        def check() -> None:
            try:
                with server.client(timeout=15) as c:
                    status = c.get("/health").status_code
            except httpx.HTTPError:
                status = -1  # the server went away: no answer at all
            answers.append((time.monotonic() - stopped_at, status))

        with cf.ThreadPoolExecutor(32) as pool:
            while server.proc.poll() is None and time.monotonic() - stopped_at < 30:
                pool.submit(check)
                time.sleep(0.6)  # the prober's pace (the thing under test), not synchronisation
        assert server.proc.poll() not in (None, 0), "the watchdog did not end the launch"
        assert answers and all(status != 200 for _, status in answers), answers
        assert any(t > 6 for t, _ in answers), answers  # probes were in flight when the watchdog fired
    finally:
        for pid in group_pids(server.pgid):
            os.kill(pid, signal.SIGCONT)
        server.kill_group()
