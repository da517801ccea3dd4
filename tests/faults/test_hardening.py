"""Defects of issue 28 against a real server on real sockets: deeply nested JSON, request smuggling,
impossible chunk sizes, WebSocket handshakes and the API key, /flush_cache on GET, and a rid reused
right after its client disconnected. Each is answered with a JSON error (or served) and the server
keeps serving."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.server import Server, running_server
from tests.faults.test_connections import read_until_closed

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

KEY = "sekret"
AUTH = f"Authorization: Bearer {KEY}\r\n"
READ_TIMEOUT_S = 6.0
GEN = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    flags = ["--api-key", KEY, "--http-read-timeout", str(READ_TIMEOUT_S), "--fault-delay-step-s", "0.005"]
    with running_server(flags) as srv:
        yield srv


def _client(server: Server) -> httpx.Client:
    return server.client(headers={"Authorization": f"Bearer {KEY}"})


def _responses(data: bytes) -> list[tuple[int, bytes, bytes]]:
    """The (status, head, body) of each HTTP/1.1 response in `data` (bodies with Content-Length)."""
    out = []
    while data.startswith(b"HTTP/1.1 "):
        head, _, rest = data.partition(b"\r\n\r\n")
        length = next(int(ln.split(b":")[1]) for ln in head.lower().split(b"\r\n") if ln.startswith(b"content-length"))
        out.append((int(head.split()[1]), head, rest[:length]))
        data = rest[length:]
    return out


def _exchange(server: Server, raw: bytes, timeout: float = READ_TIMEOUT_S + 4) -> tuple[bytes, float]:
    """Send `raw`, read until the server closes the connection; (everything read, seconds taken)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        sock.sendall(raw)
        return read_until_closed(sock)


def _post(path: str, body: bytes, extra: str = "", close: bool = False) -> bytes:
    conn = "Connection: close\r\n" if close else ""
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\n{AUTH}Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}{conn}\r\n")  # fmt: skip
    return head.encode() + body


def _deep_schema(depth: int) -> str:
    """A JSON schema of `depth` nested objects (JSON nesting about 2 x depth)."""
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth


# (path, body) nested 1000 deep or more
DEEP_BODIES = {
    "array in an unknown field": ("/generate", '{"input_ids": [1, 2], "extra": ' + "[" * 1000 + "]" * 1000 + "}"),
    "object in sampling_params": ("/generate", '{"input_ids": [1], "sampling_params": {"x": '
                                  + '{"a": ' * 1000 + "1" + "}" * 1000 + "}}"),
    "json_schema object": ("/v1/completions", '{"prompt": "a", "max_tokens": 2, "response_format": {"type": '
                           '"json_schema", "json_schema": {"name": "x", "schema": ' + _deep_schema(1000) + "}}}"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(DEEP_BODIES))
def test_deeply_nested_json_is_400_and_the_connection_keeps_serving(server: Server, name: str) -> None:
    """It used to be a 500 RecursionError and a reset of the kept-alive connection."""
    path, body = DEEP_BODIES[name]
    then = _post("/generate", json.dumps(GEN).encode(), close=True)
    data, _ = _exchange(server, _post(path, body.encode()) + then)
    answers = _responses(data)
    assert [a[0] for a in answers] == [400, 200], data[:600]
    err = json.loads(answers[0][2])["error"]
    assert "nesting too deep" in err["message"] and err["code"] == 400, err


@pytest.mark.parametrize("depth", [300, 2000], ids=["past-the-schema-bound", "past-the-decoder"])
def test_deeply_nested_json_schema_text_is_400_before_the_grammar_compiler(server: Server, depth: int) -> None:
    """SGLang's sampling_params.json_schema is JSON text: 2000 deep broke json.loads (500); 300 deep
    parsed, and the grammar compiler took minutes on it."""
    schema = _deep_schema(depth)
    t0 = time.monotonic()
    with _client(server) as client:
        sampling = {"max_new_tokens": 2, "json_schema": schema}
        r = client.post("/generate", json={"text": "a", "sampling_params": sampling})
        assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
        err = r.json()["error"]
        assert "nesting too deep" in err["message"] and err["param"] == "sampling_params.json_schema", err
        assert time.monotonic() - t0 < 10
        assert client.post("/generate", json=GEN).status_code == 200


def test_content_length_with_chunked_is_400_and_closes(server: Server) -> None:
    """Both framings (RFC 9112 §6.1): h11 read it as chunked and kept the connection, so the bytes
    after it were served as a second request."""
    body = json.dumps(GEN).encode()
    chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    head = f"POST /generate HTTP/1.1\r\nHost: x\r\n{AUTH}Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
    smuggled = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + AUTH.encode() + b"\r\n"
    data, took = _exchange(server, head.encode() + chunked + smuggled)
    answers = _responses(data)
    assert [a[0] for a in answers] == [400], data[:600]
    assert b"connection: close" in answers[0][1].lower()
    err = json.loads(answers[0][2])["error"]
    assert "Content-Length" in err["message"] and "Transfer-Encoding" in err["message"], err
    assert took < READ_TIMEOUT_S


@pytest.mark.parametrize("line_end", [b"\r\n", b""], ids=["whole-line", "line-still-open"])
def test_impossible_chunk_size_is_400_at_once(server: Server, line_end: bytes) -> None:
    """A chunk size of 2^80 is never valid: answered at once, not after the read timeout."""
    head = f"POST /generate HTTP/1.1\r\nHost: x\r\n{AUTH}Transfer-Encoding: chunked\r\n\r\n".encode()
    data, took = _exchange(server, head + b"100000000000000000000" + line_end)
    answers = _responses(data)
    assert [a[0] for a in answers] == [400], data[:600]
    assert "chunk" in json.loads(answers[0][2])["error"]["message"]
    assert took < READ_TIMEOUT_S / 2, took


WS_HEAD = ("GET /v1/models HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
           "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n")  # fmt: skip


@pytest.mark.parametrize(("auth", "status"), [("", 401), (AUTH, 400)], ids=["without-key", "with-key"])
def test_websocket_handshake_gets_a_json_error_after_the_key_check(server: Server, auth: str, status: int) -> None:
    """It used to be a text/plain 403 with an empty body, and the API key was not checked."""
    data, _ = _exchange(server, (WS_HEAD + auth + "Connection: close\r\n\r\n").encode())
    (answer,) = _responses(data)
    assert answer[0] == status and b"content-type: application/json" in answer[1].lower(), data[:600]
    err = json.loads(answer[2])["error"]
    assert err["code"] == status and ("WebSocket" in err["message"] or "API key" in err["message"]), err


def test_bearer_scheme_is_case_insensitive(server: Server) -> None:
    with server.client() as client:
        for scheme in ("bearer", "BEARER", "Bearer"):
            r = client.post("/generate", json=GEN, headers={"Authorization": f"{scheme} {KEY}"})
            assert r.status_code == 200, (scheme, r.text)
        assert client.post("/generate", json=GEN, headers={"Authorization": f"Basic {KEY}"}).status_code == 401


def test_flush_cache_changes_nothing_on_get(server: Server) -> None:
    with _client(server) as client:
        r = client.get("/flush_cache")
        assert r.status_code == 405 and r.headers["content-type"] == "application/json", r.text
        assert r.json()["error"]["code"] == 405
        assert client.post("/flush_cache").json()["success"] is True


def test_rid_is_free_once_its_client_has_disconnected(server: Server) -> None:
    """A streamed request is dropped by its client after its first event, and the same rid is sent
    at once: 6 times in 20 that was "already running"."""
    stream_body = {"input_ids": [5, 6, 7, 8], "rid": "reuse-after-cut", "stream": True,
                   "sampling_params": {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    again = {**GEN, "rid": "reuse-after-cut"}
    with _client(server) as client:
        for i in range(20):
            with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as first:
                with first.stream("POST", "/generate", json=stream_body) as r:
                    assert r.status_code == 200
                    next(r.iter_lines())
            r = client.post("/generate", json=again)
            assert r.status_code == 200, (i, r.text)
