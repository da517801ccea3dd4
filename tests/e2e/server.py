"""Start a real `launch.py` in its own process group, wait until it serves, stop exactly it.

Every process of one launch shares the process group created for launch.py
(`start_new_session=True`), so teardown kills that group and nothing else.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

DETERMINISTIC = ["--enable-deterministic-inference"]
"""Launch flags of the tests that compare outputs for exact equality (batched vs alone, cache on vs off)."""

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_pids(pgid: int) -> list[int]:
    """Live processes of a process group (Linux /proc scan), zombies excluded."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry))
    return pids


def wait_group_empty(pgid: int, timeout: float = 5.0) -> list[int]:
    """Poll until no live process of the group is left (children may exit just after launch.py);
    return what is still alive."""
    deadline = time.monotonic() + timeout
    while (left := group_pids(pgid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


class Server:
    """A launch.py subprocess. `output` accumulates its stdout+stderr (read by a thread)."""

    def __init__(self, extra_args: list[str], port: int | None = None, env: dict[str, str] | None = None,
                 prefix: list[str] | None = None, command: list[str] | None = None):  # fmt: skip
        """`prefix`: a command that execs the launch (e.g. `ip netns exec NAME`), so the pid and
        process group stay the launch's own. `command`: what runs launch.py (default `python
        launch.py`; e.g. `hyssm serve MODEL`), followed by the port, device and `extra_args` flags."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        launch = command or [sys.executable, os.path.join(ROOT, "launch.py")]
        cmd = [*launch, "--port", str(self.port), "--device", "cpu"]
        self.proc = subprocess.Popen(
            (prefix or []) + cmd + extra_args,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        self.pgid = self.proc.pid
        self.lines: list[str] = []
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if "hyssm: serving" in line:
                self._ready.set()
        self._ready.set()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout: float = 120.0) -> None:
        if not self._ready.wait(timeout) or self.proc.poll() is not None:
            raise RuntimeError(f"server did not start (exit {self.proc.poll()}):\n{self.output[-4000:]}")

    def wait_exit(self, timeout: float) -> int:
        """Wait for launch.py to exit on its own; all of its output has been read afterwards."""
        code = self.proc.wait(timeout)
        self._reader.join(10)
        return code

    def client(self, timeout: float = 60.0, **kw: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout, **kw)

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a Prometheus sample family on /metrics, over the samples carrying `labels`."""
        with self.client() as client:
            text = client.get("/metrics").text
        total = 0.0
        for line in text.splitlines():
            m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
            if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
                total += float(m.group(2))
        return total

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM launch.py, wait; SIGKILL the whole group if anything is left."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill_group()
        return self.proc.returncode

    def kill_group(self) -> None:
        kill_group(self.proc, self.pgid)


@contextmanager
def running_server(extra_args: list[str], ready_timeout: float = 120.0, **kw: object) -> Iterator[Server]:
    server = Server(extra_args, **kw)  # type: ignore[arg-type]
    try:
        server.wait_ready(ready_timeout)
        yield server
    finally:
        server.stop()


async def generate_concurrently(server: Server, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy `n`-token generations of all `prompts` at once; their output ids, in order."""
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:

        async def one(ids: list[int]) -> list[int]:
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
            r = await client.post("/generate", json=body)
            assert r.status_code == 200, r.text
            return r.json()["output_ids"]

        return await asyncio.gather(*(one(p) for p in prompts))


def kill_group(proc: subprocess.Popen, pgid: int) -> None:
    """SIGKILL every process of the group `pgid` that `proc` leads, reap `proc`, and wait until the
    group is empty."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass
    wait_group_empty(pgid, 10)
