"""A private Mooncake Store for tests: a `mooncake_master` on free local ports and a standalone
`mooncake_client` that holds the store's memory (its global segment), so values outlive the clients that
put them. Each runs under `timeout -s KILL` (a lifetime bound, should the test process die) in its own
process group; `stop` kills exactly those groups. `mooncake_service()` skips the test (pytest.skip, with
the reason) when Mooncake or the libraries it links against are missing
(tests/state_store/install_mooncake.sh installs them).

Commands (ports are free ones picked at start):
    mooncake_master --rpc_port=P --rpc_address=127.0.0.1 --metrics_port=A --metrics_host=127.0.0.1
        --enable_metric_reporting=false --logtostderr
    mooncake_client --master_server_address=127.0.0.1:P --metadata_server=P2PHANDSHAKE --host=127.0.0.1
        --port=C --global_segment_size=<bytes> --local_buffer_size=0 --protocol=tcp --logtostderr
The master is ready when http://127.0.0.1:A/health says service_ready; the client, when
http://127.0.0.1:A/get_all_segments lists a segment.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

START_WAIT_S = 20.0
STOP_WAIT_S = 5.0
LIFETIME_S = 600
SEGMENT_BYTES = 64 << 20


def mooncake_bin_dir() -> Path:
    """The folder of the wheel's binaries; skips the test when Mooncake cannot run here."""
    try:
        import mooncake.store  # loads the extension and the RDMA libraries it links against
    except (ImportError, OSError) as e:
        pytest.skip(f"Mooncake Store does not load ({e}); tests/state_store/install_mooncake.sh installs it")
    folder = Path(mooncake.store.__file__).parent
    for name in ("mooncake_master", "mooncake_client"):
        if not os.access(folder / name, os.X_OK):
            pytest.skip(f"the Mooncake wheel has no executable {name} in {folder}")
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return response.read().decode()
    except OSError:
        return None


class MooncakeService:
    """A master and a standalone client (started by `start`); see the module docstring."""

    def __init__(self, log_dir: Path, segment_bytes: int = SEGMENT_BYTES, lifetime_s: int = LIFETIME_S) -> None:
        self.bin_dir = mooncake_bin_dir()
        self.log_dir = log_dir
        self.segment_bytes = segment_bytes
        self.lifetime_s = lifetime_s
        self.rpc_port, self.admin_port, self.client_port = free_port(), free_port(), free_port()
        self.master: subprocess.Popen[bytes] | None = None
        self.client: subprocess.Popen[bytes] | None = None

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    def _spawn(self, name: str, flags: list[str]) -> subprocess.Popen[bytes]:
        argv = [str(self.bin_dir / name), *flags]
        if (timeout := shutil.which("timeout")) is not None:
            argv = [timeout, "-s", "KILL", str(self.lifetime_s), *argv]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"{name}.log", "ab") as log:
            return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def _wait(self, what: str, proc: subprocess.Popen[bytes], ready: Any) -> None:
        deadline = time.monotonic() + START_WAIT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            if ready():
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{what} did not start (exit {proc.poll()}): {self.log_tail()}")

    def log_tail(self, chars: int = 2000) -> str:
        return " | ".join(f"{p.name}: {p.read_text(errors='replace')[-chars:]}" for p in self.log_dir.glob("*.log"))

    def _master_ready(self) -> bool:
        body = _http(f"http://127.0.0.1:{self.admin_port}/health")
        try:
            return body is not None and json.loads(body).get("service_ready") is True
        except ValueError:
            return False

    def segments(self) -> list[str]:
        """The segments the master has mounted (empty when it does not answer)."""
        body = _http(f"http://127.0.0.1:{self.admin_port}/get_all_segments")
        return body.split() if body else []

    def start_master(self) -> None:
        self.master = self._spawn("mooncake_master", [
            f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1", f"--metrics_port={self.admin_port}",
            "--metrics_host=127.0.0.1", "--enable_metric_reporting=false", "--logtostderr"])
        self._wait("mooncake_master", self.master, self._master_ready)

    def start_client(self) -> None:
        self.client = self._spawn("mooncake_client", [
            f"--master_server_address={self.master_address}", "--metadata_server=P2PHANDSHAKE",
            "--host=127.0.0.1", f"--port={self.client_port}", f"--global_segment_size={self.segment_bytes}",
            "--local_buffer_size=0", "--protocol=tcp", "--logtostderr"])
        self.wait_for_segment()

    def wait_for_segment(self) -> None:
        """Until the master has a segment mounted (the client mounts again after a master restart)."""
        assert self.client is not None
        self._wait("mooncake_client's segment", self.client, lambda: bool(self.segments()))

    def start(self) -> MooncakeService:
        self.start_master()
        self.start_client()
        return self

    @staticmethod
    def _kill(proc: subprocess.Popen[bytes] | None, sig: int) -> None:
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)  # its own group (start_new_session): timeout and the binary
        try:
            proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(STOP_WAIT_S)

    def kill_master(self) -> None:
        """A crash: SIGKILL (a restarted master starts empty)."""
        self._kill(self.master, signal.SIGKILL)

    def stop(self) -> None:
        self._kill(self.client, signal.SIGTERM)
        self._kill(self.master, signal.SIGTERM)

    @contextlib.contextmanager
    def raw_client(self) -> Iterator[Any]:
        """A plain `MooncakeDistributedStore` of this service (no segment, a 16 MiB transfer buffer)."""
        from mooncake.store import MooncakeDistributedStore

        client = MooncakeDistributedStore()
        rc = client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", self.master_address)
        assert rc == 0, f"Mooncake setup: {rc}"
        try:
            yield client
        finally:
            client.close()


@contextlib.contextmanager
def mooncake_service(log_dir: Path, segment_bytes: int = SEGMENT_BYTES) -> Iterator[MooncakeService]:
    """A started service, stopped (its processes killed) on exit; skips the test without Mooncake."""
    service = MooncakeService(log_dir, segment_bytes)
    try:
        yield service.start()
    finally:
        service.stop()
