"""Processes of a running server for soak.py: which they are, and what memory and fds each holds now.

- the processes: the launcher pid and every live descendant (psutil when installed, else a walk of
  the ppid fields in /proc, see peers_procs.process_tree);
- kind of a process, from its title (hyssm's children set ``hyssm::<name>``, e.g. ``hyssm::worker-tp0``):
  ``launcher`` for the root, ``tokenizer`` / ``scheduler`` / ``worker`` for the matching names
  (``-dp<D>`` / ``-tp<R>`` suffixes kept in ``name``), ``other`` for anything else (a process a
  library starts);
- a sample: VmRSS, RssAnon, RssFile, RssShmem (MiB, from /proc/PID/status; VmRSS is their sum) and
  the number of entries of /proc/PID/fd. A process that exits while it is read is left out of that
  sample. The worker's state pools are private anonymous mappings (worker_proc.host.memory.zeros), so
  their touched pages count under RssAnon with its heap, and mapped libraries under RssFile.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

from benchmarks.peers_procs import process_tree

logger = logging.getLogger(__name__)

KINDS = ("launcher", "tokenizer", "scheduler", "worker", "other")
TITLE_PREFIX = "hyssm::"
_STATUS_KEYS = {"VmRSS:": "rss_mb", "RssAnon:": "rss_anon_mb", "RssFile:": "rss_file_mb",
                "RssShmem:": "rss_shmem_mb"}  # fmt: skip


@dataclass(frozen=True)
class ProcSample:
    """One process at one moment: identity, resident memory in MiB and open fd count."""

    pid: int
    kind: str
    name: str
    rss_mb: float
    rss_anon_mb: float
    rss_file_mb: float
    rss_shmem_mb: float
    fds: int

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def server_pids(root: int) -> list[int]:
    """root and its live descendants, root first."""
    try:
        import psutil
    except ImportError:
        return process_tree(root)
    try:
        parent = psutil.Process(root)
        return [root, *(p.pid for p in parent.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def classify(pid: int, root: int, cmdline: str) -> tuple[str, str]:
    """(kind, name) of a server process from its pid and command line."""
    if pid == root:
        return "launcher", "launcher"
    first = cmdline.split()[0] if cmdline.split() else ""
    if first.startswith(TITLE_PREFIX):
        name = first.removeprefix(TITLE_PREFIX)
        kind = name.split("-", 1)[0]
        return (kind if kind in KINDS else "other"), name
    return "other", f"other-{pid}"


def parse_status(text: str) -> dict[str, float]:
    """The VmRSS / RssAnon / RssFile / RssShmem fields of /proc/PID/status in MiB (0.0 when absent)."""
    out = dict.fromkeys(_STATUS_KEYS.values(), 0.0)
    for line in text.splitlines():
        key = line.split(maxsplit=1)[0] if line else ""
        if key in _STATUS_KEYS:
            out[_STATUS_KEYS[key]] = int(line.split()[1]) / 1024.0
    return out


def sample_process(pid: int, root: int, proc: Path = Path("/proc")) -> ProcSample | None:
    """The current sample of one process; None when it is gone (or unreadable)."""
    base = proc / str(pid)
    try:
        cmdline = (base / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        mem = parse_status((base / "status").read_text())
        fds = len(os.listdir(base / "fd"))
    except OSError:
        return None
    kind, name = classify(pid, root, cmdline)
    return ProcSample(pid=pid, kind=kind, name=name, fds=fds, **mem)


def sample_server(root: int) -> list[ProcSample]:
    """A sample of every live process of the server rooted at `root`."""
    out = []
    for pid in server_pids(root):
        s = sample_process(pid, root)
        if s is not None:
            out.append(s)
    return out


def listener_pid(url: str) -> int | None:
    """The launcher pid (see launcher_of) of the process listening on a loopback URL's port; None when
    there is none, the URL is not local, or psutil is not installed."""
    try:
        import psutil
    except ImportError:
        logger.warning("psutil is not installed: pass --pid to sample an existing server")
        return None
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if socket.gethostbyname(parts.hostname or "127.0.0.1") not in ("127.0.0.1", "0.0.0.0"):
        return None
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
            return launcher_of(conn.pid)
    return None


def launcher_of(pid: int) -> int:
    """The launcher above a server process: the highest ancestor whose command line names launch.py
    or a hyssm entry point (the process itself when there is none)."""
    import psutil

    best = pid
    try:
        proc = psutil.Process(pid)
        for parent in proc.parents():
            line = " ".join(parent.cmdline())
            if "launch.py" in line or "hyssm" in line:
                best = parent.pid
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass
    return best
