"""Processes of bench_peers: start a server on a free loopback port, wait for its health endpoint,
sample the peak RSS of its process tree from /proc, and stop exactly what was started.

Contracts:
- every process is started in a new session (its own process group), so stopping it signals that
  group only: SIGTERM, then SIGKILL after `grace_s`; nothing else on the machine is touched;
- readiness = the health URL answers 200 before the deadline; the process exiting first, or the
  deadline passing, raises PeerError with the tail of its log;
- RSS = the sum of VmRSS over the root process and all its descendants (found through the ppid field
  of /proc/PID/stat), sampled every `interval_s` by a daemon thread; the peak is kept;
- CPU time of a tree = the sum of utime + stime of its live processes (`tree_cpu_seconds`), what
  peers_settle reads to tell that a server has gone quiet.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)


class PeerError(RuntimeError):
    """A peer could not be started or measured; the message says why."""


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """Within the block, SIGTERM to this benchmark raises KeyboardInterrupt, so every `finally` that
    stops a started server runs (Python's default for SIGTERM exits at once and leaves them running)."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_ppid(stat_text: str) -> int:
    """The ppid field of a /proc/PID/stat line (the command name may contain spaces and parens)."""
    return int(stat_text[stat_text.rindex(")") + 2 :].split()[1])


def parse_vmrss_kb(status_text: str) -> int:
    """VmRSS in kB from /proc/PID/status (0 when absent, e.g. a zombie)."""
    for line in status_text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def process_tree(root: int, proc: Path = Path("/proc")) -> list[int]:
    """root and every live descendant of it."""
    children: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = parse_ppid((entry / "stat").read_text())
        except (OSError, ValueError, IndexError):
            continue  # exited while we looked
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def tree_rss_bytes(root: int, proc: Path = Path("/proc")) -> int:
    total = 0
    for pid in process_tree(root, proc):
        try:
            total += parse_vmrss_kb((proc / str(pid) / "status").read_text()) * 1024
        except OSError:
            continue
    return total


def parse_cpu_ticks(stat_text: str) -> int:
    """utime + stime (clock ticks) from a /proc/PID/stat line."""
    fields = stat_text[stat_text.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])


def tree_cpu_seconds(root: int, proc: Path = Path("/proc")) -> float:
    """CPU seconds (user + system) the live processes of root's tree have used so far."""
    ticks = 0
    for pid in process_tree(root, proc):
        try:
            ticks += parse_cpu_ticks((proc / str(pid) / "stat").read_text())
        except (OSError, ValueError, IndexError):
            continue  # exited while we looked
    return ticks / os.sysconf("SC_CLK_TCK")


class RssSampler:
    """Peak tree RSS of one root pid, sampled in a daemon thread until stop()."""

    def __init__(self, root: int, interval_s: float = 0.25) -> None:
        self.root, self.interval_s, self.peak_bytes = root, interval_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rss-{root}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, tree_rss_bytes(self.root))
            self._stop.wait(self.interval_s)  # sampling period, not synchronisation

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.peak_bytes


class ManagedProcess:
    """A child process (and its process group) with its log file and RSS sampler."""

    def __init__(self, name: str, cmd: Sequence[str], log_path: Path, cwd: str | None = None) -> None:
        self.name, self.cmd, self.log_path = name, list(cmd), log_path
        logger.info("starting %s: %s", name, " ".join(self.cmd))
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True
        )
        self.rss = RssSampler(self.proc.pid)
        self.peak_rss_bytes = 0

    def log_tail(self, n: int = 20) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def wait_ready(self, health_url: str, deadline_s: float) -> float:
        """Poll health_url until it answers 200; returns the seconds it took."""
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise PeerError(
                    f"{self.name} exited with {self.proc.returncode} before it was ready:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(health_url, timeout=5) as resp:
                    if resp.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, OSError):
                pass  # not listening yet, or 503 while loading
            if time.monotonic() - t0 > deadline_s:
                raise PeerError(f"{self.name} not ready within {deadline_s:.0f}s ({health_url}):\n{self.log_tail()}")
            time.sleep(0.5)  # polling period of the readiness probe

    def wait(self, timeout_s: float) -> int:
        """Wait for a process that ends by itself (a batch job); raises PeerError on timeout."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            raise PeerError(f"{self.name} did not finish within {timeout_s:.0f}s:\n{self.log_tail()}") from e

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the process group, SIGKILL it after grace_s; idempotent."""
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                logger.warning("%s ignored SIGTERM for %.0fs; killing its process group", self.name, grace_s)
                self._signal(signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._signal(signal.SIGKILL)  # children left behind in the group, if any
        self.peak_rss_bytes = max(self.peak_rss_bytes, self.rss.stop())
        if not self._log.closed:
            self._log.close()

    def _signal(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
