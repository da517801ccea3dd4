"""The request/response flow every generation endpoint shares.

An endpoint decodes and prepares its body (`AppContext.prepare`), then calls `respond` with
three functions of its own format: `events` (the SSE frames of its pieces), `error_for` (which
finishes are errors on that API) and `payload` (the whole answer as JSON). Rules:

- `precheck` runs before the response starts, so a request that cannot start (scheduler down,
  rid taken) gets a plain 503/400 even when it asked for a stream;
- a stream always ends with `data: [DONE]`, preceded by one error event when anything failed;
  the endpoint's `events` only formats pieces and error finishes;
- a non-streaming request whose client leaves is aborted (closing `generate`) and answered
  with a 499 (`ClientGoneResponse`);
- the rid's reservation is released when the generation ends, and at the latest when the
  response is over (also when the generation never started).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from tokenizer_proc.context import AppContext
from tokenizer_proc.errors import ApiError, internal_error, unavailable
from tokenizer_proc.generation import BackendUnavailable, Finish, Piece, generate, precheck
from tokenizer_proc.http_util import (
    SSE_DONE,
    ClientGoneResponse,
    SSEResponse,
    json_response,
    run_unless_disconnected,
    sse,
)
from tokenizer_proc.validation import PreparedRequest

EventsFn = Callable[[AsyncIterator[Piece]], AsyncGenerator[bytes, None]]
ErrorFn = Callable[[Finish | None], ApiError | None]


@dataclass
class Accumulated:
    """The output of one request so far (one per request, held by its handler)."""

    text: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    last: Piece | None = None

    def add(self, piece: Piece) -> None:
        self.text.append(piece.text)
        self.ids.extend(piece.token_ids)
        if piece.logprobs is not None:
            self.logprobs.extend(piece.logprobs)
        if piece.top_logprobs is not None:
            self.top_logprobs.extend(piece.top_logprobs)
        if piece.prompt_logprobs is not None:
            self.prompt_logprobs = piece.prompt_logprobs
            self.prompt_top_logprobs = piece.prompt_top_logprobs
        self.last = piece


def finish_error(finish: Finish | None, abort_is_error: bool) -> ApiError | None:
    """The error a finish is on an API: "rejected" (the request can never run) is a 400,
    "error" a 503, and "abort" a 503 only where the API has no abort finish (`abort_is_error`)."""
    if finish is None:
        return None
    if finish.reason == "rejected":
        return ApiError(400, finish.message or "the request can never run on this server")
    if finish.reason == "error" or (abort_is_error and finish.reason == "abort"):
        return unavailable(finish.message or f"the request ended with {finish.reason}")
    return None


async def collect(pieces: AsyncIterator[Piece]) -> Accumulated:
    acc = Accumulated()
    async with contextlib.aclosing(pieces) as it:  # type: ignore[type-var]
        async for piece in it:
            acc.add(piece)
    return acc


async def ended(frames: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
    """`frames`, then `[DONE]`; any failure becomes one error event before it. Every SSE stream of
    the API goes through this; closing it closes `frames`."""
    try:
        async with contextlib.aclosing(frames) as it:
            async for frame in it:
                yield frame
    except BackendUnavailable as e:
        yield sse(unavailable(str(e)).body())
    except ApiError as e:
        yield sse(e.body())
    except Exception as e:  # noqa: BLE001 - a stream always ends with an error event and [DONE]
        yield sse(internal_error(e).body())
    yield SSE_DONE


async def _stream(pieces: AsyncGenerator[Piece, None], events: EventsFn) -> AsyncGenerator[bytes, None]:
    """`ended(events(pieces))`; closing this closes both generators (so an unfinished request is aborted)."""
    async with contextlib.aclosing(pieces), contextlib.aclosing(ended(events(pieces))) as frames:
        async for frame in frames:
            yield frame


async def respond(
    ctx: AppContext,
    req: PreparedRequest,
    request: Request,
    events: EventsFn,
    error_for: ErrorFn,
    payload: Callable[[Accumulated], Any],
) -> Response:
    """Run `req` and answer it: an SSE stream of `events` (`req.stream`), or the whole output
    collected and answered with `payload`, or the error `error_for` makes of its finish."""
    try:
        hold = precheck(ctx.backend, req, ctx.in_flight)
    except BackendUnavailable as e:
        raise unavailable(str(e)) from e
    pieces = ctx.latency.timed(generate(ctx.backend, ctx.tok, req, ctx.in_flight, hold))
    if req.stream:
        return SSEResponse(_stream(pieces, events), on_close=lambda: ctx.in_flight.release(hold))  # type: ignore[return-value]
    try:
        async with contextlib.aclosing(pieces):
            completed, acc = await run_unless_disconnected(collect(pieces), request)
    except BackendUnavailable as e:
        raise unavailable(str(e)) from e
    finally:
        ctx.in_flight.release(hold)  # also when `pieces` never started
    if not completed or acc is None:
        return ClientGoneResponse()
    err = error_for(acc.last.finish if acc.last else None)
    if err is not None:
        raise err
    return json_response(payload(acc))
