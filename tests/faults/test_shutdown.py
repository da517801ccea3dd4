"""Graceful shutdown and injected step errors (issue 7); shutdown by a group signal, restarts on
the same port and run directories of killed launches (issue 17)."""

from __future__ import annotations

import concurrent.futures as cf
import os
import shutil
import signal
import socket
import tempfile
import threading
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


GRACE_S = 8.0  # these tests run into the end of the grace period; 30 tokens finish well within it
SHORT_GRACE = ["--graceful-shutdown-timeout", str(GRACE_S)]
CLOSE_BOUND_S = 12.0  # from the end of the grace period until launch.py has exited (a loaded 2-core box)


def test_sigterm_answers_in_flight_requests_and_exits_zero() -> None:
    server = Server(["--fault-delay-step-s", "0.01", *SHORT_GRACE])
    try:
        server.wait_ready()
        with cf.ThreadPoolExecutor(8) as pool:
            short = [pool.submit(_gen, server, 5) for _ in range(4)]
            long = [pool.submit(_gen, server, 4000, True) for _ in range(4)]
            for f in short:
                assert f.result(60).status_code == 200
            t0 = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            code = server.wait_exit(GRACE_S + CLOSE_BOUND_S + 10)
            elapsed = time.monotonic() - t0
            answers = [f.result(20) for f in long]
        assert code == 0, server.output[-3000:]
        assert elapsed < GRACE_S + CLOSE_BOUND_S, elapsed
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


STREAMS = {
    "/generate": {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 4000, "temperature": 0,
                                                                   "ignore_eos": True}},
    "/v1/completions": {"prompt": [5, 6, 7, 8], "max_tokens": 4000, "temperature": 0, "ignore_eos": True},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000,
                             "temperature": 0, "ignore_eos": True},
}


def _stream(server: Server, path: str, started: threading.Semaphore, n: int = 4000) -> list[str]:
    """The lines of one streamed request of `n` tokens; releases `started` at its first event."""
    body = {**STREAMS[path], "stream": True}
    if path == "/generate":
        body["sampling_params"] = {**body["sampling_params"], "max_new_tokens": n}
    else:
        body["max_tokens"] = n
    lines: list[str] = []
    with httpx.Client(base_url=server.url, timeout=60) as client:
        with client.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    if len(lines) == 1:
                        started.release()
    return lines


def test_group_sigterm_is_a_graceful_shutdown_with_exit_zero() -> None:
    """SIGTERM to the whole process group (systemd, Kubernetes, `kill -- -PGID`) behaves like
    SIGTERM to launch.py: in-flight requests on every entry point get the grace period, streams
    end with a final event and [DONE], no process is reported as crashed, exit code 0."""
    server = Server(["--fault-delay-step-s", "0.01", *SHORT_GRACE])
    try:
        server.wait_ready()
        run_dir = next(ln for ln in server.lines if "run directory" in ln).rsplit(" ", 1)[1].strip()
        started = threading.Semaphore(0)
        with cf.ThreadPoolExecutor(8) as pool:
            streams = {p: pool.submit(_stream, server, p, started) for p in STREAMS}
            shorts = {p: pool.submit(_stream, server, p, started, 30) for p in STREAMS}
            for _ in range(2 * len(STREAMS)):  # every request is in flight
                assert started.acquire(timeout=60), server.output[-3000:]
            t0 = time.monotonic()
            os.killpg(server.pgid, signal.SIGTERM)
            code = server.wait_exit(GRACE_S + CLOSE_BOUND_S + 10)
            elapsed = time.monotonic() - t0
            short_answers = {p: f.result(30) for p, f in shorts.items()}
            stream_lines = {p: f.result(30) for p, f in streams.items()}
        assert code == 0, server.output[-3000:]
        assert GRACE_S - 0.5 < elapsed < GRACE_S + CLOSE_BOUND_S, elapsed  # the grace period was given, and bounded
        for path, lines in short_answers.items():  # short requests finished inside the grace period
            assert lines[-1] == "data: [DONE]" and '"length"' in lines[-2], (path, lines[-3:])
        for path, lines in stream_lines.items():
            assert lines[-1] == "data: [DONE]", (path, lines[-3:])
            assert "shutting down" in lines[-2], (path, lines[-2])
        out = server.output
        assert "exited unexpectedly" not in out and " ERROR " not in out, out[-3000:]
        assert wait_group_empty(server.pgid) == []
        assert not os.path.exists(run_dir)
    finally:
        server.kill_group()


def test_restart_on_the_same_port_right_after_a_stop() -> None:
    """Connections the old server closed sit in TIME_WAIT on its port; the next start must not
    take them for a server that is still listening."""
    first = Server([])
    try:
        first.wait_ready()
        idle = socket.create_connection(("127.0.0.1", first.port))  # the server closes it on shutdown
        with first.client() as client:
            assert client.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
                               ).status_code == 200  # fmt: skip
        assert first.stop() == 0
        idle.close()
    finally:
        first.kill_group()
    with running_server([], port=first.port) as second:
        with second.client() as client:
            assert client.get("/health").status_code == 200


def test_sigkilled_launch_leaves_no_run_directory_behind(tmp_path_factory: pytest.TempPathFactory) -> None:
    """launch.py killed with SIGKILL cannot clean up; its children die with it, and the next start
    removes the orphaned run directory (and only directories whose launch is gone)."""
    tmp = tempfile.mkdtemp(prefix="hy17-")  # short: ipc paths live under it
    try:
        env = {"TMPDIR": tmp}
        victim = Server([], env=env)
        try:
            victim.wait_ready()
            (orphan,) = os.listdir(tmp)
            os.kill(victim.proc.pid, signal.SIGKILL)
            victim.proc.wait(10)
            assert wait_group_empty(victim.pgid, 10) == []
            assert os.path.isdir(os.path.join(tmp, orphan))  # nobody could clean it so far
        finally:
            victim.kill_group()
        foreign = os.path.join(tmp, "hyssm-not-a-run-dir")  # no lock file: never touched
        os.mkdir(foreign)
        with running_server([], env=env) as second:
            left = sorted(os.listdir(tmp))
            assert orphan not in left and "hyssm-not-a-run-dir" in left and len(left) == 2, left
            assert "removed 1 run directories" in second.output
        assert os.listdir(tmp) == ["hyssm-not-a-run-dir"]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
