"""Start a real sglang-router (the `sglang-router` package's Rust binary, through its Python
launcher) in front of hyssm servers, wait until it routes to them, stop exactly it.

The router runs in its own process group (`start_new_session=True`); teardown kills that group
and nothing else. Its log goes to a file (read on failure), so a full pipe never blocks it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import httpx
import pytest

from tests.e2e.server import free_port, kill_group


def require_router() -> None:
    """Skip the calling test, naming why, when the sglang-router package is not installed."""
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        pytest.skip("sglang-router is not installed (pip install sglang-router; it is in the test extra)")


class Router:
    """A `python -m sglang_router.launch_router` subprocess over `worker_urls`."""

    def __init__(self, worker_urls: Sequence[str], log_path: str, policy: str = "cache_aware",
                 extra: Sequence[str] = ()) -> None:  # fmt: skip
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.worker_urls = list(worker_urls)
        self.log_path = log_path
        cmd = [
            sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),  # its default 29000 may be taken
            "--policy", policy, "--worker-urls", *self.worker_urls, "--log-level", "warn",
            "--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--health-check-timeout-secs", "5",
            *extra,
        ]  # fmt: skip
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self.pgid = self.proc.pid

    @property
    def output(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def workers(self) -> dict[str, bool]:
        """worker url -> healthy, as the router's GET /workers reports them."""
        with httpx.Client(timeout=5) as c:
            doc = c.get(self.url + "/workers").json()
        return {w["url"]: bool(w["is_healthy"]) for w in doc["workers"]}

    def wait_workers(self, want: dict[str, bool], timeout: float = 60.0) -> None:
        """Poll GET /workers until every url in `want` has the given health."""
        deadline = time.monotonic() + timeout
        seen: object = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.output[-3000:]}")
            try:
                seen = self.workers()
                if all(seen.get(u) is h for u, h in want.items()):  # type: ignore[union-attr]
                    return
            except (httpx.HTTPError, ValueError, KeyError) as e:
                seen = e
            time.sleep(0.1)
        raise TimeoutError(f"router workers never became {want}: last {seen}\n{self.output[-3000:]}")

    def wait_ready(self, timeout: float = 60.0) -> None:
        self.wait_workers({u: True for u in self.worker_urls}, timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        kill_group(self.proc, self.pgid)
        self._log.close()


@contextmanager
def running_router(worker_urls: Sequence[str], log_path: str, **kw: object) -> Iterator[Router]:
    router = Router(worker_urls, log_path, **kw)  # type: ignore[arg-type]
    try:
        router.wait_ready()
        yield router
    finally:
        router.stop()
