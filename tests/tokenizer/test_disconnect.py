"""Client disconnects (streaming and not) and server-side cancellation abort the request at the
backend exactly once and leave nothing in flight. Drives the ASGI app directly so the test
controls when `http.disconnect` arrives."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tests.tokenizer.conftest import FakeBackend
from tokenizer_proc import create_app
from tokenizer_proc.context import AppContext


class FakeConnection:
    """One HTTP request as the ASGI server sees it; `gone` makes receive() report a disconnect."""

    def __init__(self, body: dict[str, Any], disconnect_after_chunks: int | None = None,
                 send_raises_when_gone: bool = False):
        self.body = json.dumps(body).encode()
        self.raises = send_raises_when_gone
        self.sent: list[dict[str, Any]] = []
        self.gone = asyncio.Event()
        self._body_sent = False
        self._after = disconnect_after_chunks

    async def receive(self) -> dict[str, Any]:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        if self.gone.is_set():  # uvicorn drops the message; ASGI spec 2.4 servers raise OSError
            if self.raises:
                raise OSError("client is gone")
            return
        self.sent.append(message)
        chunks = [m for m in self.sent if m["type"] == "http.response.body" and m.get("body")]
        if self._after is not None and len(chunks) >= self._after:
            self.gone.set()


def _scope(path: str) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "headers": [(b"content-type", b"application/json"), (b"host", b"t")],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}


def _assert_clean(app: Any, backend: FakeBackend, expected_reason: str) -> None:
    ctx: AppContext = app.state.ctx
    ctx.check_integrity()
    assert len(ctx.in_flight) == 0
    assert [reason for _, reason in backend.aborted] == [expected_reason]
    assert backend.aborted[0][0] == backend.submitted[0].rid
    backend.check_integrity()


@pytest.mark.parametrize("raises", [False, True])
@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_disconnect_while_streaming_aborts(args, tok, path: str, raises: bool) -> None:
    backend = FakeBackend(gate=asyncio.Event(), free_outputs=2)
    app = create_app(args, backend, tok)  # type: ignore[arg-type]
    body = {"stream": True, **({"text": "a"} if path == "/generate" else {"prompt": "a"})}
    conn = FakeConnection(body, disconnect_after_chunks=2, send_raises_when_gone=raises)

    async def main() -> None:
        await asyncio.wait_for(app(_scope(path), conn.receive, conn.send), 10)

    asyncio.run(main())
    assert conn.sent[0]["status"] == 200
    _assert_clean(app, backend, "client disconnected")
    assert not backend.finished


@pytest.mark.parametrize("raises", [False, True])
@pytest.mark.parametrize("path", ["/generate", "/v1/chat/completions"])
def test_disconnect_while_waiting_non_streaming_aborts(args, tok, path: str, raises: bool) -> None:
    backend = FakeBackend(gate=asyncio.Event(), free_outputs=1)
    app = create_app(args, backend, tok)  # type: ignore[arg-type]
    body = {"text": "a"} if path == "/generate" else {"messages": [{"role": "user", "content": "a"}]}
    conn = FakeConnection(body, send_raises_when_gone=raises)

    async def main() -> None:
        call = asyncio.ensure_future(app(_scope(path), conn.receive, conn.send))
        while not backend.submitted:
            await asyncio.sleep(0)
        conn.gone.set()  # the client hangs up while the request waits on the (gated) backend
        await asyncio.wait_for(call, 10)

    asyncio.run(main())
    _assert_clean(app, backend, "client disconnected")
    assert app.state.ctx.metrics.requests[(path, 499)] == 1


def test_server_cancelling_a_request_aborts_it(args, tok) -> None:
    """Like uvicorn's shutdown after its grace period: the request's task is cancelled."""
    backend = FakeBackend(gate=asyncio.Event(), free_outputs=1)
    app = create_app(args, backend, tok)  # type: ignore[arg-type]
    conn = FakeConnection({"text": "a", "stream": True})

    async def main() -> None:
        call = asyncio.ensure_future(app(_scope("/generate"), conn.receive, conn.send))
        while not backend.submitted or not backend.open_streams:
            await asyncio.sleep(0)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call

    asyncio.run(main())
    _assert_clean(app, backend, "client disconnected")


def test_completed_request_is_not_aborted(args, tok) -> None:
    backend = FakeBackend()
    app = create_app(args, backend, tok)  # type: ignore[arg-type]
    conn = FakeConnection({"text": "a", "stream": True, "sampling_params": {"max_new_tokens": 3}})
    asyncio.run(asyncio.wait_for(app(_scope("/generate"), conn.receive, conn.send), 10))
    frames = b"".join(m.get("body", b"") for m in conn.sent if m["type"] == "http.response.body")
    assert frames.endswith(b"data: [DONE]\n\n")
    assert backend.aborted == [] and backend.finished == [backend.submitted[0].rid]
    backend.check_integrity()


def test_disconnect_while_sending_the_body(args, tok) -> None:
    backend = FakeBackend()
    app = create_app(args, backend, tok)  # type: ignore[arg-type]
    sent: list[dict[str, Any]] = []
    messages = [{"type": "http.request", "body": b'{"text": ', "more_body": True}, {"type": "http.disconnect"}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(asyncio.wait_for(app(_scope("/generate"), receive, send), 10))
    assert sent[0]["status"] == 499
    assert backend.submitted == []
    assert app.state.ctx.metrics.requests[("/generate", 499)] == 1


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_every_choice(args, tok, stream: bool) -> None:
    """n > 1 and a batch of prompts: a client that leaves aborts each unfinished choice once."""
    backend = FakeBackend(gate=asyncio.Event(), free_outputs=1)
    app = create_app(args, backend, tok)  # type: ignore[arg-type]
    conn = FakeConnection({"prompt": ["a", "b"], "n": 2, "stream": stream})

    async def main() -> None:
        call = asyncio.ensure_future(app(_scope("/v1/completions"), conn.receive, conn.send))
        while len(backend.submitted) < 4 or len(backend.open_streams) < 4:
            await asyncio.sleep(0)
        conn.gone.set()
        await asyncio.wait_for(call, 10)

    asyncio.run(main())
    ctx: AppContext = app.state.ctx
    ctx.check_integrity()
    assert len(ctx.in_flight) == 0
    assert sorted(rid for rid, _ in backend.aborted) == sorted(r.rid for r in backend.submitted)
    assert {reason for _, reason in backend.aborted} == {"client disconnected"} and len(backend.aborted) == 4
    backend.check_integrity()
