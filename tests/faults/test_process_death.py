"""Process death and hangs during load (issue 7): every client gets a final answer, launch.py
exits non-zero, and no process of the launch remains — each within a bound."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import threading
import time

import pytest

from tests.e2e.server import Server, group_pids, wait_group_empty
from tests.long_request import LongRequest

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


def _run_fault(extra: list[str], title: str, sig: int = signal.SIGKILL) -> None:
    server = Server(["--fault-delay-step-s", "0.02", *extra])
    try:
        server.wait_ready()
        started = threading.Semaphore(0)
        clients = [LongRequest(server.url, stream=i % 2 == 0, started=started) for i in range(16)]
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


def test_a_child_whose_launcher_died_before_it_started_exits_at_once() -> None:
    """The launcher's pid travels with a child's arguments: a child that starts after its launcher died
    (the death signal can only be asked for once it runs) exits before it loads anything."""
    import subprocess
    import sys

    import msgspec

    from shared.child_process import BOOTSTRAP
    from shared.config import ServerArgs

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True, timeout=60).stdout.strip()  # fmt: skip
    payload = msgspec.msgpack.encode([list(sys.path), "scheduler", ServerArgs().to_bytes(), None, int(gone)])
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", BOOTSTRAP], input=payload, capture_output=True, timeout=60)
    assert out.returncode == 1 and out.stderr == b"", out.stderr[-2000:]
    assert time.monotonic() - started < BOUND_S
