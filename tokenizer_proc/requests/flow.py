"""The request/response flow every generation endpoint shares.

An endpoint decodes and prepares its body (`AppContext.prepare`) into one or several requests (the
choices of `n` > 1, a batch of prompts), then calls `respond`, the one pipeline, with three functions
of its own format: `events` (the SSE frames of the merged pieces), `error_for` (which finishes are
errors on that API) and `payload` (the whole answer as JSON). Rules:

- `precheck` runs for every request before the response starts, so a request that cannot start
  (scheduler down, rid taken) gets a plain 503/400 even when it asked for a stream (a refusal
  releases the rids already reserved); so do the admission checks (admission.py: a request that can
  never fit the KV pool is a 400, a full queue or a draining server a 503 with Retry-After);
- several choices of one prompt compute it once (prompt_sharing.py); streamed, their pieces are
  interleaved in arrival order (`merge`); whole, they are collected concurrently and the first
  failure cancels (and so aborts) the rest;
- a stream always ends with `data: [DONE]`, preceded by one error event when anything failed;
  the endpoint's `events` only formats pieces and error finishes;
- a non-streaming request whose client leaves is aborted (closing `generate`) and answered
  with a 499 (`ClientGoneResponse`);
- the rids' reservations are released when the generations end, and at the latest when the
  response is over (also when a generation never started).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response

from shared.config import ServerArgs
from tokenizer_proc.http.errors import ApiError, internal_error, unavailable
from tokenizer_proc.http.plumbing import (
    SSE_DONE,
    ClientGoneResponse,
    SSEResponse,
    json_response,
    run_unless_disconnected,
    sse,
)
from tokenizer_proc.requests.admission import Admission
from tokenizer_proc.requests.generation import (
    Backend,
    BackendUnavailable,
    Finish,
    InFlight,
    Piece,
    Reservation,
    generate,
    precheck,
)
from tokenizer_proc.requests.latency import LatencyStats
from tokenizer_proc.requests.prepare import PreparedRequest
from tokenizer_proc.requests.prompt_sharing import after, opens, share_prompts
from tokenizer_proc.requests.tokenizer import TextTokenizer


class Serving(Protocol):
    """What the pipeline uses of an app's shared state (tokenizer_proc.context.AppContext satisfies it)."""

    @property
    def args(self) -> ServerArgs: ...
    @property
    def backend(self) -> Backend: ...
    @property
    def tok(self) -> TextTokenizer: ...
    @property
    def in_flight(self) -> InFlight: ...
    @property
    def admission(self) -> Admission: ...
    @property
    def latency(self) -> LatencyStats: ...
    @property
    def matching(self) -> Executor: ...


EventsFn = Callable[[AsyncGenerator[tuple[int, Piece], None]], AsyncGenerator[bytes, None]]
"""The SSE frames of an endpoint's format over the merged (position, piece) stream of its requests."""
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
    prompt_ranks: list[int] | None = None
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
            self.prompt_ranks = piece.prompt_ranks
        self.last = piece


def finish_error(finish: Finish | None, abort_is_error: bool) -> ApiError | None:
    """The error a finish is on an API: "rejected" (the client's fault, TokenOut.rejected) is a 400,
    "error" a 503, and "abort" a 503 only where the API has no abort finish (`abort_is_error`)."""
    if finish is None:
        return None
    if finish.reason == "rejected":
        return ApiError(400, finish.message or "the request can never run on this server", finish.param)
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


_END = object()


async def merge(iters: Sequence[AsyncIterator[Piece]]) -> AsyncGenerator[tuple[int, Piece], None]:
    """(choice position, piece) from every iterator, as they arrive; an iterator's exception is
    raised here. Closing this generator closes every iterator."""
    if len(iters) == 1:
        async with contextlib.aclosing(iters[0]) as it:  # type: ignore[type-var]
            async for piece in it:
                yield 0, piece
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, source: AsyncIterator[Piece]) -> None:
        try:
            async with contextlib.aclosing(source) as it:  # type: ignore[type-var]
                async for piece in it:
                    queue.put_nowait((i, piece))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((i, e))
            return
        queue.put_nowait((i, _END))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(iters)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is _END:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect_all(iters: Sequence[AsyncIterator[Piece]]) -> list[Accumulated]:
    tasks = [asyncio.ensure_future(collect(it)) for it in iters]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            if t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def respond(
    ctx: Serving,
    reqs: Sequence[PreparedRequest],
    request: Request,
    events: EventsFn,
    error_for: ErrorFn,
    payload: Callable[[list[Accumulated]], Any],
) -> Response:
    """Run `reqs` (one request, or the choices of `n` > 1 and of a batch of prompts) and answer them:
    an SSE stream of `events` over their merged (position, piece) stream (`req.stream`), or every
    output collected and answered with `payload` (in `reqs` order), or the error `error_for` makes of
    the first failed finish."""
    holds: list[Reservation] = []
    reqs, gates = share_prompts(reqs, not ctx.args.disable_radix_cache)

    def release_all() -> None:
        for h in holds:
            ctx.in_flight.release(h)

    await ctx.admission.check_fits(ctx.backend, reqs)
    await ctx.in_flight.settle([r.rid for r in reqs])
    # from the admission check to the last reservation nothing awaits: no request races past the limit
    ctx.admission.admit(len(ctx.in_flight), len(reqs))
    try:
        for r in reqs:
            holds.append(precheck(ctx.backend, r, ctx.in_flight))
    except BackendUnavailable as e:
        release_all()
        raise unavailable(str(e)) from e
    except ApiError:
        release_all()
        raise
    iters = []
    for r, h in zip(reqs, holds, strict=True):
        pieces: AsyncIterator[Piece] = generate(ctx.backend, ctx.tok, r, ctx.in_flight, h, ctx.matching)
        if (gate := gates.get(r.prompt_index)) is not None:
            pieces = opens(pieces, gate) if r.save_prompt_state else after(pieces, gate)
        iters.append(ctx.latency.timed(pieces))
    if reqs[0].stream:
        return SSEResponse(events(merge(iters)), on_close=release_all)  # type: ignore[return-value]
    try:
        completed, accs = await run_unless_disconnected(collect_all(iters), request)
    except BackendUnavailable as e:
        raise unavailable(str(e)) from e
    finally:
        release_all()
    if not completed or accs is None:
        return ClientGoneResponse()
    for acc in accs:
        err = error_for(acc.last.finish if acc.last else None)
        if err is not None:
            raise err
    return json_response(payload(accs))
