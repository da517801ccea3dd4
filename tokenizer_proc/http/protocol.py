"""The HTTP/1.1 connection protocol of the tokenizer: uvicorn's h11 protocol plus the limits it lacks.

uvicorn gives the keep-alive timeout (a connection idle between requests is closed) and the h11
header-size limit. This subclass adds, per connection:
- a connection idle before its first byte is closed after the same keep-alive timeout;
- once the first byte of a request has arrived, its head and body must be complete within
  `read_timeout_s`, else it is answered 408 and closed (slow or partial headers, a body shorter
  than its Content-Length);
- at most `max_connections` connections are open; one more is answered 503 and closed at once,
  before it costs more than its file descriptor for a moment;
- every HTTP-level error (a request h11 cannot parse: bad request line, bad Content-Length, bad
  chunk size, missing Host, both Content-Length and Transfer-Encoding) is answered with the API's
  JSON error body naming the problem and the connection closes; a header block over
  `max_header_bytes` is 431; a chunk size that can never be valid (over 16 hex digits) is a 400
  and a declared chunk over the body limit a 413 as soon as its size line arrives;
- no request is upgraded (WebSocket handshakes are answered by the app as plain HTTP).
uvicorn's `limit_concurrency` is not used: it only refuses *requests* (text/plain 503) and keeps
idle connections, which is what exhausts file descriptors. Connections closed by these rules are
logged (`ShedLog`, at most one line per reason and second). These answers are written as raw bytes
followed by a close, so they need no h11 state (a request head may not even be complete).
"""

from __future__ import annotations

import asyncio
import http
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import h11
import msgspec
from h11._readers import ChunkedReader
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from tokenizer_proc.http.errors import ApiError

logger = logging.getLogger(__name__)

SHED_LINGER_S = 1.0
MAX_LINGERING = 64


@dataclass(frozen=True)
class HttpLimits:
    read_timeout_s: float
    max_connections: int
    max_header_bytes: int = 16 * 1024  # h11's default incomplete-event limit
    max_body_bytes: int = 0  # a declared chunk larger than this is a 413 at once (0 = not checked here)


MAX_CHUNK_SIZE_DIGITS = 16  # hex digits of a chunk size: 16 cover every 64-bit size


def error_bytes(status: int, message: str) -> bytes:
    """A complete HTTP/1.1 response carrying the API's JSON error body; the connection closes."""
    body = msgspec.json.encode(ApiError(status, message).body())
    head = (
        f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class ShedLog:
    """Counts connections closed by a limit and logs each reason at most once per `interval_s`
    (the count since its previous line is in the next line). One per server."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self.lingering = 0  # shed connections still open until their client has read the 503
        self.total: Counter[str] = Counter()
        self._since: Counter[str] = Counter()
        self._logged_at: dict[str, float] = {}

    def note(self, reason: str, level: int, detail: str) -> None:
        self.total[reason] += 1
        self._since[reason] += 1
        now = time.monotonic()
        if now - self._logged_at.get(reason, -self.interval_s) >= self.interval_s:
            logger.log(level, "closed %d HTTP connection(s): %s", self._since[reason], detail)
            self._since[reason] = 0
            self._logged_at[reason] = now


class _RecordingConnection(h11.Connection):
    """h11.Connection that keeps the last protocol error of the peer (uvicorn drops it), and refuses
    a request carrying both Content-Length and Transfer-Encoding: h11 would read it as chunked and
    keep the connection, so bytes a front proxy took for this request's body would be served as a
    second request (RFC 9112 §6.1 request smuggling); it is a 400 and the connection closes."""

    error: h11.RemoteProtocolError | None = None

    def next_event(self) -> Any:
        try:
            event = super().next_event()
            if isinstance(event, h11.Request) and _framed_twice(event.headers):
                raise h11.RemoteProtocolError(
                    "a request with both Content-Length and Transfer-Encoding is refused (RFC 9112 section 6.1)", 400
                )
            return event
        except h11.RemoteProtocolError as e:
            self.error = e
            raise


def _framed_twice(headers: Any) -> bool:
    names = {name.lower() for name, _ in headers}
    return b"content-length" in names and b"transfer-encoding" in names


class LimitedH11Protocol(H11Protocol):
    """uvicorn's H11Protocol with the rules of this module; `protocol_class` binds the limits."""

    LIMITS: HttpLimits
    SHED: ShedLog

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:  # fmt: skip
        super().__init__(config, server_state, app_state, _loop)
        self.conn = _RecordingConnection(h11.SERVER, self.LIMITS.max_header_bytes)
        self._deadline: asyncio.TimerHandle | None = None
        self._shed = False
        self._lingering = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        limit = self.LIMITS.max_connections
        if len(self.connections) >= limit:
            self._shed_connection(transport, limit)
            return
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def _shed_connection(self, transport: asyncio.Transport, limit: int) -> None:
        """503 and close. Closing with the request unread would reset the connection before the
        client reads the answer, so the write side is shut and what arrives is discarded for up to
        SHED_LINGER_S; at most MAX_LINGERING connections linger, the others are closed at once."""
        self.transport, self._shed = transport, True
        self.SHED.note("limit", logging.WARNING, f"{limit} connections are open (--max-connections)")
        transport.write(error_bytes(503, f"too many open connections (the limit is {limit}); retry later"))
        if self.SHED.lingering >= MAX_LINGERING or not transport.can_write_eof():
            transport.close()
            return
        self.SHED.lingering += 1
        self._lingering = True
        transport.write_eof()
        self._deadline = self.loop.call_later(SHED_LINGER_S, transport.close)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        if self._lingering:
            self._lingering = False
            self.SHED.lingering -= 1
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._shed:
            return
        if self.conn.their_state is h11.IDLE:  # receiving a request head
            if self._deadline is None:  # a request begins
                self._deadline = self.loop.call_later(self.LIMITS.read_timeout_s, self._read_timed_out)
            if self._head_too_large(data):
                self._unset_keepalive_if_required()
                self._answer_and_close(431, f"the request header block exceeds {self.LIMITS.max_header_bytes} bytes")
                return
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.SEND_BODY and not self.transport.is_closing() and (bad := self._chunk_problem()) is not None:
            self._answer_and_close(*bad)
            return
        if state is not h11.SEND_BODY and not (state is h11.IDLE and self.conn.trailing_data[0]):
            self._cancel_deadline()  # the request is in (or the connection is done with)

    def _chunk_problem(self) -> tuple[int, str] | None:
        """A chunked body known to be refused before its bytes arrive (else it would wait for the read
        timeout): a chunk-size line past MAX_CHUNK_SIZE_DIGITS hex digits (2^64 and more: no real size)
        is a 400, a declared chunk larger than the body limit a 413. Reads h11's chunked-reader state."""
        reader = getattr(self.conn, "_reader", None)
        if not isinstance(reader, ChunkedReader) or reader._reading_trailer:
            return None
        limit = self.LIMITS.max_body_bytes
        if reader._bytes_in_chunk:
            if limit and reader._bytes_in_chunk > limit:
                return 413, f"a chunk of {reader._bytes_in_chunk} bytes exceeds the body limit of {limit} bytes"
            return None
        line = self.conn.trailing_data[0].lstrip(b"\r\n")
        size = line.split(b";", 1)[0].split(b"\r", 1)[0].strip()
        if len(size) > MAX_CHUNK_SIZE_DIGITS:
            return 400, f"invalid HTTP request: chunk size {size[:24].decode('latin-1')!r}... is too large"
        return None

    def _head_too_large(self, data: bytes) -> bool:
        """h11 limits only a head that is still incomplete; one that arrives whole is checked here."""
        limit = self.LIMITS.max_header_bytes
        buffered = self.conn.trailing_data[0]
        if len(buffered) + len(data) <= limit:
            return False
        end = (buffered + data).find(b"\r\n\r\n")
        return end < 0 or end > limit

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _read_timed_out(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        t = self.LIMITS.read_timeout_s
        self.SHED.note("read_timeout", logging.INFO, f"a request was not complete within {t:g} s (--http-read-timeout)")
        self._answer_and_close(408, f"the request was not received completely within {t:g} s")

    def send_400_response(self, msg: str) -> None:
        err = getattr(self.conn, "error", None)
        status = err.error_status_hint if err is not None else 400
        if status == 431:
            message = f"the request header block exceeds {self.LIMITS.max_header_bytes} bytes"
        else:
            message = f"invalid HTTP request: {err or msg}"
        self._answer_and_close(status, message)

    def _answer_and_close(self, status: int, message: str) -> None:
        """Answer `status` unless a response to this request has begun (then only close)."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # the app is reading this request: it sees a disconnect and sends nothing more
            cycle.disconnected = True
            cycle.message_event.set()
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            self.transport.write(error_bytes(status, message))
        self.transport.close()

    def _should_upgrade(self) -> bool:
        """Never: there is no WebSocket (or other upgraded) endpoint. A handshake stays a plain HTTP
        request, which the app answers with a JSON error after the API-key check (app.py)."""
        return False

    def timeout_keep_alive_handler(self) -> None:
        logger.debug("closing an idle HTTP connection from %s", self.client)
        super().timeout_keep_alive_handler()


def protocol_class(limits: HttpLimits) -> type[LimitedH11Protocol]:
    """A protocol class for `uvicorn.Config(http=...)` bound to `limits` and one ShedLog."""
    return type("BoundH11Protocol", (LimitedH11Protocol,), {"LIMITS": limits, "SHED": ShedLog()})
