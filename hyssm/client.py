"""HTTP to the engine's own tokenizer process: its unix socket (or the TCP port the caller asked for).

Owner: `hyssm.Engine`, one `Client` per engine. It speaks the server's own API (POST /generate,
/v1/chat/completions, ...), so every request is validated, scheduled and answered exactly as over
HTTP. Error rules (what a caller of the engine sees):
- a 4xx answer is a `RequestError` carrying the server's message and field;
- an error event in a stream is what its `code` says (a 4xx there: the request's own fault, found
  while it ran, such as an output constraint no token can continue);
- a 503 answer, a 5xx error event, or a broken connection is `EngineDeadError` naming the
  failure once the processes report one (waited for briefly: the tokenizer may learn of a death
  first), else `EngineError` with the server's message; a 503 with Retry-After (the server at
  capacity, or draining) is that EngineError at once;
- no timeout on reading an answer: generations may be long, and a death always ends the wait
  (the tokenizer answers every waiting request, or its socket closes when it is stopped).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn

import httpx

from hyssm.errors import EngineDeadError, EngineError, RequestError

logger = logging.getLogger(__name__)

DEATH_WAIT_S = 3.0  # how long a failed call waits for the processes to name a failure
_TIMEOUT = httpx.Timeout(None, connect=30.0)


class Client:
    """Sync and async calls to one tokenizer process. `death(timeout)` returns the recorded failure
    (waiting up to `timeout` for one), or "" while every process is alive."""

    def __init__(self, base_url: str, uds: str, api_key: str, death: Callable[[float], str]) -> None:
        self.base_url, self.uds, self._death = base_url, uds, death
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        transport = httpx.HTTPTransport(uds=uds) if uds else None
        self._sync = httpx.Client(base_url=base_url, transport=transport, timeout=_TIMEOUT, headers=self.headers)

    def close(self) -> None:
        self._sync.close()

    def async_client(self) -> httpx.AsyncClient:
        """A client for the running event loop (httpx's async clients belong to one loop)."""
        transport = httpx.AsyncHTTPTransport(uds=self.uds) if self.uds else None
        return httpx.AsyncClient(base_url=self.base_url, transport=transport, timeout=_TIMEOUT, headers=self.headers)

    def check_alive(self) -> None:
        failure = self._death(0.0)
        if failure:
            raise EngineDeadError(f"the engine is down: {failure}")

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        self.check_alive()
        try:
            r = self._sync.request(method, path, json=body)
        except httpx.TransportError as e:
            self.transport_failed(e)
        return self.answer(r.status_code, r.content, "retry-after" in r.headers)

    async def arequest(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        self.check_alive()
        try:
            async with self.async_client() as client:
                r = await client.request(method, path, json=body)
        except httpx.TransportError as e:
            self.transport_failed(e)
        return self.answer(r.status_code, r.content, "retry-after" in r.headers)

    async def stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The objects of a server-sent event stream, up to `[DONE]`; an error event raises."""
        self.check_alive()
        try:
            async with self.async_client() as client, client.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    self.answer(r.status_code, await r.aread(), "retry-after" in r.headers)
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line.removeprefix("data: ")
                    if data == "[DONE]":
                        return
                    obj = json.loads(data)
                    if isinstance(obj, dict) and "error" in obj and set(obj) == {"error"}:
                        code = obj["error"].get("code")
                        self.failed(code if isinstance(code, int) and 400 <= code < 600 else 503, obj["error"])
                    yield obj
        except httpx.TransportError as e:
            self.transport_failed(e)
        self.transport_failed(None)  # the stream ended without [DONE]

    def answer(self, status: int, content: bytes, refusal: bool = False) -> Any:
        """The decoded body of a 200; else the error it is. `refusal`: the answer carried Retry-After
        (a server at capacity or draining, alive: EngineError at once)."""
        try:
            obj = json.loads(content) if content else None
        except ValueError:
            obj = None
        if status == 200:
            return obj
        error = obj.get("error") if isinstance(obj, dict) else None
        self.failed(status, error if isinstance(error, dict) else {"message": content.decode(errors="replace")},
                    refusal)

    def failed(self, status: int, error: dict[str, Any], refusal: bool = False) -> NoReturn:
        message = str(error.get("message") or f"HTTP {status}")
        if 400 <= status < 500:
            raise RequestError(message, status, error.get("param"))
        failure = self._death(DEATH_WAIT_S) if status == 503 and not refusal else self._death(0.0)
        if failure:
            raise EngineDeadError(f"the engine is down: {failure}" + ("" if failure in message else f" ({message})"))
        raise EngineError(f"HTTP {status}: {message}")

    def transport_failed(self, e: BaseException | None) -> NoReturn:
        failure = self._death(DEATH_WAIT_S)
        what = f"{type(e).__name__}: {e}" if e is not None else "the answer was cut off"
        raise EngineDeadError(f"the engine is down: {failure or 'its HTTP server went away'} ({what})") from e
