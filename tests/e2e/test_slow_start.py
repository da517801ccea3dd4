"""A first start longer than --startup-timeout comes up while its ranks give word; a rank that never
comes still fails the start after the timeout (worker_proc/startup_beacon.py)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.e2e.server import ROOT, Server, free_port, wait_group_empty

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

TIMEOUT_S = 3.0
LOADING_S = 3 * TIMEOUT_S  # the worker's start lasts three start-up timeouts


def test_a_start_longer_than_the_timeout_comes_up_while_the_rank_gives_word() -> None:
    t0 = time.monotonic()
    server = Server(["--startup-timeout", str(TIMEOUT_S), "--fault-delay-start-s", str(LOADING_S)])
    try:
        server.wait_ready(150)
        assert time.monotonic() - t0 >= LOADING_S  # the start outlasted the timeout, and came up
        with server.client() as client:
            body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
            r = client.post("/generate", json=body)
        assert r.status_code == 200, r.text
        assert len(r.json()["output_ids"]) == 4
    finally:
        server.stop()
    assert "did not report ready" not in server.output and "not ready within" not in server.output


def test_a_rank_that_never_comes_fails_the_start_after_the_timeout() -> None:
    """Node 0 of a two-node launch whose node 1 is never started: rank 0 gives word while it waits, rank 1
    says nothing, so the start fails after about the timeout, naming what is missing."""
    addr = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "launch.py", "--device", "cpu", "--port", str(free_port()), "--nnodes", "2",
           "--node-rank", "0", "--tp-size", "2", "--dist-init-addr", addr, "--startup-timeout", str(TIMEOUT_S)]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        wait_group_empty(proc.pid)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    assert TIMEOUT_S <= elapsed < 60, err
    assert "worker ranks [1] (nodes [1]) did not report ready" in err, err  # rank 0 gave word: not named
