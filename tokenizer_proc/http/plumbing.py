"""HTTP plumbing: bounded body reading, client-disconnect detection, server-sent events.

Disconnect rule (streaming or not): the request's work runs as its own task next to a task
that waits for `http.disconnect`; whichever ends first cancels the other. Cancelling the work
closes the `generate()` iterator, whose `finally` aborts the request at the scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any, TypeVar

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from tokenizer_proc.http.errors import ApiError

logger = logging.getLogger(__name__)

T = TypeVar("T")

CLIENT_CLOSED = 499  # nginx's "client closed request": recorded in metrics, never seen by a client
SSE_DONE = b"data: [DONE]\n\n"
_ENCODER = msgspec.json.Encoder()


def sse(obj: Any) -> bytes:
    return b"data: " + _ENCODER.encode(obj) + b"\n\n"


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(_ENCODER.encode(obj), status_code=status, media_type="application/json")


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or ApiError 413 as soon as it is known to exceed `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ApiError(400, "invalid Content-Length header", "content-length")
        if int(declared) > limit:
            raise ApiError(413, f"request body is {declared} bytes; the limit is {limit} (--max-body-bytes)")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes (--max-body-bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


async def wait_disconnect(receive: Receive) -> None:
    """Return when the client has gone (call only after the body has been read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _cancel_all(*tasks: asyncio.Future[Any]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def run_unless_disconnected(work: Coroutine[Any, Any, T], request: Request) -> tuple[bool, T | None]:
    """Run `work` until it completes or the client disconnects. Returns (completed, result);
    an exception of `work` propagates. On disconnect `work` is cancelled (and so aborted)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            await _cancel_all(task)
        await _cancel_all(watch)
    if task.cancelled():
        return False, None
    return True, task.result()


class ClientGoneResponse(Response):
    """The answer to a client that disconnected: status 499 (for the metrics); a failure to
    send it (the connection is closed) is expected and ignored."""

    def __init__(self) -> None:
        super().__init__(status_code=CLIENT_CLOSED)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        with contextlib.suppress(OSError, ClientDisconnect):
            await super().__call__(scope, receive, send)


class SSEResponse:
    """A text/event-stream response over an async generator of encoded SSE frames.

    The generator is closed (`aclose`) when the client disconnects, when sending fails or when
    this task is cancelled; it must turn its own errors into error events before `[DONE]`."""

    def __init__(self, events: AsyncGenerator[bytes, None], on_close: Callable[[], None] | None = None):
        self.events = events
        self.status_code = 200
        self.on_close = on_close  # called once the response is over, however it ended

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._respond(receive, send)
        finally:
            await self.events.aclose()  # a generator that never started holds nothing; closing is safe
            if self.on_close is not None:
                self.on_close()

    async def _respond(self, receive: Receive, send: Send) -> None:
        await send({
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no"),
            ],
        })
        pump = asyncio.ensure_future(self._pump(send))
        watch = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await _cancel_all(pump, watch)
        if pump.done() and not pump.cancelled() and (err := pump.exception()) is not None:
            if isinstance(err, (OSError, ClientDisconnect)):
                logger.debug("client went away while streaming: %s", err)
            else:
                logger.error("streaming response failed: %r", err)

    async def _pump(self, send: Send) -> None:
        async with contextlib.aclosing(self.events) as events:
            async for frame in events:
                await send({"type": "http.response.body", "body": frame, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
