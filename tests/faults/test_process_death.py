"""Process death and hangs during load (issue 7): every client gets a final answer, launch.py
exits non-zero, and no process of the launch remains — each within a bound."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import threading
import time

import httpx
import pytest

from tests.e2e.server import Server, group_pids, wait_group_empty

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(180)]

BOUND_S = 10.0


def find_process(server: Server, title: str) -> int:
    """pid of the launch's process whose title (set with setproctitle) is `title`."""
    for pid in group_pids(server.pgid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        if cmdline.split(" ")[0] == title:
            return pid
    raise LookupError(f"no process titled {title!r} in {group_pids(server.pgid)}")


class Client:
    """One request in a thread; records how it ended and when."""

    def __init__(self, server: Server, stream: bool, started: threading.Semaphore) -> None:
        self.server, self.stream, self.started = server, stream, started
        self.outcome = ""
        self.ended_at = 0.0

    def __call__(self) -> None:
        body = {
            "input_ids": list(range(1, 30)),
            "stream": self.stream,
            "sampling_params": {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True},
        }
        try:
            with httpx.Client(base_url=self.server.url, timeout=60) as c:
                if self.stream:
                    with c.stream("POST", "/generate", json=body) as r:
                        done = False
                        for line in r.iter_lines():
                            done = done or line == "data: [DONE]"
                            if line.startswith("data: ") and '"error"' in line:
                                self.outcome = "error-event"
                            elif line.startswith("data: ") and not self.outcome:
                                self.outcome = "streaming"
                                self.started.release()
                    if not (self.outcome == "error-event" and done):
                        self.outcome = "closed"
                else:
                    self.started.release()
                    r = c.post("/generate", json=body)
                    has_error_body = r.status_code != 200 and "error" in r.json()
                    self.outcome = f"http-{r.status_code}" + ("" if has_error_body else "-without-error-body")
        except httpx.HTTPError as e:
            self.outcome = f"closed:{type(e).__name__}"
        self.ended_at = time.monotonic()


def _run_fault(extra: list[str], title: str, sig: int = signal.SIGKILL) -> None:
    server = Server(["--fault-delay-step-s", "0.02", *extra])
    try:
        server.wait_ready()
        started = threading.Semaphore(0)
        clients = [Client(server, stream=i % 2 == 0, started=started) for i in range(16)]
        with cf.ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(c) for c in clients]
            for _ in clients:
                assert started.acquire(timeout=60), server.output[-3000:]
            os.kill(find_process(server, title), sig)
            t0 = time.monotonic()
            cf.wait(futures, timeout=BOUND_S + 20)
            code = server.wait_exit(BOUND_S + 20)
            t_exit = time.monotonic() - t0
        for c in clients:
            assert c.ended_at and c.ended_at - t0 <= BOUND_S, (c.outcome, server.output[-3000:])
            if title == "hyssm::tokenizer":  # the HTTP server itself died: connections close
                assert c.outcome.startswith("closed"), c.outcome
            else:  # the tokenizer answers: a 503 JSON error, or an error event then [DONE]
                assert c.outcome == ("error-event" if c.stream else "http-503"), c.outcome
        assert code != 0
        assert t_exit <= BOUND_S, t_exit
        assert wait_group_empty(server.pgid) == []
    finally:
        if sig == signal.SIGSTOP:
            for pid in group_pids(server.pgid):
                os.kill(pid, signal.SIGCONT)
        server.kill_group()


@pytest.mark.parametrize("title", ["hyssm::tokenizer", "hyssm::scheduler", "hyssm::worker-tp0"])
def test_sigkill_single_rank(title: str) -> None:
    _run_fault([], title)


@pytest.mark.parametrize("title", ["hyssm::worker-tp0", "hyssm::worker-tp1"])
def test_sigkill_tp2(title: str) -> None:
    _run_fault(["--tp-size", "2"], title)


def test_sigstop_worker_fires_watchdog() -> None:
    _run_fault(["--watchdog-timeout", "3"], "hyssm::worker-tp0", sig=signal.SIGSTOP)
