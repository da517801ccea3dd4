"""Start-up errors exit non-zero with one line and leave no process behind (issue 3)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.e2e.server import ROOT, Server, free_port, wait_group_empty

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def _launch(args: list[str]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "launch.py", "--device", "cpu", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=90, start_new_session=True)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--model-path", "/definitely/not/here"], "/definitely/not/here"),
        (["--tp-size", "0"], "--tp-size"),
        (["--max-running-requests", "-3"], "--max-running-requests"),
        (["--dtype", "float64"], "--dtype"),
        (["--port", "70000"], "--port"),
        (["--chunked-prefill-size", "4096", "--max-prefill-tokens", "1024"], "--max-prefill-tokens"),
        (["--nnodes", "2", "--tp-size", "2"], "--dist-init-addr"),
        (["--nnodes", "2"], "--nnodes"),
        (["--mem-fraction-static", "1.5"], "--mem-fraction-static"),
        (["--mem-fraction-static", "0"], "--mem-fraction-static"),
    ],
)
def test_bad_flags_fail_with_one_line(args: list[str], needle: str) -> None:
    res = _launch(["--port", str(free_port()), *args])
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert needle in lines[0]


def test_unknown_architecture(tmp_path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "vocab_size": 10}')
    res = _launch(["--port", str(free_port()), "--model-path", str(tmp_path)])
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode != 0 and len(lines) == 1, res.stderr
    from shared.families.registry import SUPPORTED_ARCHITECTURES

    assert "LlamaForCausalLM" in lines[0] and all(a in lines[0] for a in SUPPORTED_ARCHITECTURES)


def test_port_in_use_fails_and_leaves_nothing() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        server = Server([], port=port)
        code = server.wait_exit(60)
        assert code != 0
        assert str(port) in server.output.strip().splitlines()[-1]
        assert wait_group_empty(server.pgid) == []


def test_api_key_required() -> None:
    from tests.e2e.server import running_server

    with running_server(["--api-key", "sekrit"]) as srv, srv.client() as client:
        body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
        assert client.post("/generate", json=body).status_code == 401
        bad = client.post("/generate", json=body, headers={"Authorization": "Bearer wrong"})
        assert bad.status_code == 401 and "error" in bad.json()
        ok = client.post("/generate", json=body, headers={"Authorization": "Bearer sekrit"})
        assert ok.status_code == 200, ok.text
        assert client.get("/health").status_code == 200
