"""--dp-size 2: replicas fail independently (issue 16). A killed worker ends its replica's in-flight
requests with errors within a bound while the other replica's finish; new requests go to the replica
left, /health says degraded; killing the last replica ends the launch with no process left."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import threading
import time

import httpx
import pytest

from tests.e2e.server import Server, group_pids, wait_group_empty
from tests.faults.test_process_death import find_process

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(240)]

BOUND_S = 10.0
NEW_TOKENS = 200


class Client:
    """One /generate request in a thread (streamed or not); records how it ended and when."""

    def __init__(self, server: Server, index: int, stream: bool, started: threading.Semaphore) -> None:
        self.server, self.index, self.stream, self.started = server, index, stream, started
        self.outcome = ""
        self.tokens = 0
        self.ended_at = 0.0

    def body(self) -> dict:
        ids = [(self.index * 7 + k) % 250 + 1 for k in range(24)]  # distinct prompts: routed by load
        return {"input_ids": ids, "stream": self.stream,
                "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}}

    def __call__(self) -> None:
        try:
            with httpx.Client(base_url=self.server.url, timeout=120) as c:
                if self.stream:
                    self._stream(c)
                else:
                    self.started.release()
                    r = c.post("/generate", json=self.body())
                    if r.status_code == 200:
                        self.tokens = len(r.json()["output_ids"])
                        self.outcome = "ok"
                    else:
                        self.outcome = f"http-{r.status_code}" + ("" if "error" in r.json() else "-no-error-body")
        except httpx.HTTPError as e:
            self.outcome = f"closed:{type(e).__name__}"
        self.ended_at = time.monotonic()

    def _stream(self, c: httpx.Client) -> None:
        import json

        done, error, first = False, False, True
        with c.stream("POST", "/generate", json=self.body()) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    error = error or "error" in event
                    self.tokens = len(event.get("output_ids", [])) or self.tokens
                    if first:
                        first = False
                        self.started.release()
        self.outcome = ("error-event" if error else "ok") if done else "closed"


def titles(server: Server) -> set[str]:
    out = set()
    for pid in group_pids(server.pgid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                out.add(f.read().split(b"\0")[0].decode(errors="replace"))
        except OSError:
            continue  # exited meanwhile
    return out


def wait_titles_gone(server: Server, names: set[str], timeout: float = BOUND_S) -> set[str]:
    """Poll until no process of the launch has one of `names` as its title; return those still there."""
    deadline = time.monotonic() + timeout
    while (left := names & titles(server)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _replicas(server: Server) -> list[dict]:
    with server.client() as client:
        return client.get("/get_server_info").json()["replicas"]


@pytest.mark.parametrize(("first", "sig", "last"), [
    ("worker-dp1-tp0", signal.SIGKILL, "worker-dp0-tp0"),
    ("scheduler-dp0", signal.SIGKILL, "scheduler-dp1"),
    ("worker-dp1-tp0", signal.SIGSTOP, "worker-dp0-tp0"),  # a hung worker: its scheduler's watchdog fires
])
def test_killed_replica_fails_alone_then_last_one_ends_the_launch(first: str, sig: int, last: str) -> None:
    dead = int(first.split("-dp")[1][0])
    alive = 1 - dead
    server = Server(["--dp-size", "2", "--fault-delay-step-s", "0.02", "--watchdog-timeout", "3"])
    try:
        server.wait_ready()
        started = threading.Semaphore(0)
        clients = [Client(server, i, stream=i % 2 == 0, started=started) for i in range(12)]
        with cf.ThreadPoolExecutor(len(clients)) as pool:
            futures = [pool.submit(c) for c in clients]
            for _ in clients:
                assert started.acquire(timeout=60), server.output[-3000:]
            loads = [r["in_flight_requests"] for r in _replicas(server)]
            assert loads[0] > 0 and loads[1] > 0, loads  # distinct prompts are spread by load
            os.kill(find_process(server, f"hyssm::{first}"), sig)
            t0 = time.monotonic()
            cf.wait(futures, timeout=60)
        failed = [c for c in clients if c.outcome != "ok"]
        for c in failed:  # the dead replica's requests: a 503 JSON error, or an error event then [DONE]
            assert c.outcome == ("error-event" if c.stream else "http-503"), c.outcome
            assert c.ended_at - t0 <= BOUND_S, (c.ended_at - t0, server.output[-3000:])
        for c in clients:
            assert c.outcome in ("ok", "error-event", "http-503"), c.outcome
            if c.outcome == "ok":
                assert c.tokens == NEW_TOKENS
        # every request of the dead replica failed (none was finished when it died), none of the other's did
        assert len(failed) == loads[dead], ([c.outcome for c in clients], loads)
        assert server.proc.poll() is None, server.output[-3000:]

        with server.client() as client:
            health = client.get("/health")
            assert health.status_code == 200, health.text
            assert health.json() == {"status": "ok", "degraded": True, "replicas_up": 1, "dp_size": 2}
            replicas = _replicas(server)
            assert [r["up"] for r in replicas] == [d == alive for d in (0, 1)]
            exited = first if sig == signal.SIGKILL else f"scheduler-dp{dead}"  # the watchdog ends the scheduler
            assert f"{exited} exited unexpectedly" in replicas[dead]["error"], replicas[dead]["error"]
            routed_before = sum(replicas[alive]["routed_requests"].values())
            for i in range(4):
                short = {"input_ids": [5 + i, 6, 7], "sampling_params": {"max_new_tokens": 4}}
                r = client.post("/generate", json=short)
                assert r.status_code == 200, r.text
            assert sum(_replicas(server)[alive]["routed_requests"].values()) == routed_before + 4
            assert f'hyssm_dp_replica_up{{dp_rank="{dead}"}} 0.0' in client.get("/metrics").text
        assert wait_titles_gone(server, {f"hyssm::scheduler-dp{dead}", f"hyssm::worker-dp{dead}-tp0"}) == set()

        os.kill(find_process(server, f"hyssm::{last}"), signal.SIGKILL)
        code = server.wait_exit(BOUND_S + 10)
        assert code != 0
        assert "no replica is left" in server.output, server.output[-3000:]
        assert wait_group_empty(server.pgid) == []
    finally:
        server.kill_group()


def test_sigterm_stops_every_replica_gracefully() -> None:
    """SIGTERM with requests in flight on both replicas and a drain shorter than they need: each is answered
    (finish "abort" once the grace is over), exit 0, nothing left."""
    server = Server(["--dp-size", "2", "--fault-delay-step-s", "0.05", "--graceful-shutdown-timeout", "1"])
    try:
        server.wait_ready()
        started = threading.Semaphore(0)
        clients = [Client(server, i, stream=False, started=started) for i in range(4)]
        with cf.ThreadPoolExecutor(len(clients)) as pool:
            futures = [pool.submit(c) for c in clients]
            for _ in clients:
                assert started.acquire(timeout=60)
            deadline = time.monotonic() + 30
            while min(r["in_flight_requests"] for r in _replicas(server)) == 0:  # both replicas decoding
                assert time.monotonic() < deadline, _replicas(server)
                time.sleep(0.05)
            server.proc.send_signal(signal.SIGTERM)
            code = server.wait_exit(BOUND_S + 10)
            cf.wait(futures, timeout=BOUND_S)
        assert code == 0, server.output[-3000:]
        # answered 200 with the tokens so far (aborted at shutdown), before max_new_tokens
        assert all(c.outcome == "ok" and 0 < c.tokens < NEW_TOKENS for c in clients), [
            (c.outcome, c.tokens) for c in clients]
        assert wait_group_empty(server.pgid) == []
    finally:
        server.kill_group()
