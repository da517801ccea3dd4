"""Several generations answered as one response (the choices of `n` > 1 and of a batch of prompts).

Rules: every choice's rid is reserved before the response starts (a refusal releases the ones
already taken). With the prefix cache on, of several choices of one prompt the first is submitted
with `save_prompt_state` and the others only once it has produced its first output (or ended), so
they find its prompt, and its state before the last prompt token, in the cache: the prompt is
computed once, plus its last token once per further choice (`share_prompts`). Streamed, the
choices' pieces are interleaved in arrival order (`merge`), and when the consumer stops early
(client gone, error) every unfinished choice is closed, so `generate()` aborts it at the scheduler
exactly once; whole, the choices are collected concurrently and the first failure cancels (and so
aborts) the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from tokenizer_proc.context import AppContext
from tokenizer_proc.errors import ApiError, unavailable
from tokenizer_proc.flow import Accumulated, collect
from tokenizer_proc.generation import BackendUnavailable, Finish, Piece, Reservation, generate, precheck
from tokenizer_proc.http_util import ClientGoneResponse, SSEResponse, json_response, run_unless_disconnected
from tokenizer_proc.validation import PreparedRequest

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


def share_prompts(ctx: AppContext, reqs: Sequence[PreparedRequest]) -> tuple[list[PreparedRequest],
                                                                            dict[int, asyncio.Event]]:
    """The requests with the first choice of each shared prompt marked, and one gate per such prompt."""
    if ctx.args.disable_radix_cache:
        return list(reqs), {}
    counts: dict[int, int] = {}
    for r in reqs:
        counts[r.prompt_index] = counts.get(r.prompt_index, 0) + 1
    gates: dict[int, asyncio.Event] = {}
    out = []
    for r in reqs:
        if counts[r.prompt_index] > 1 and r.sampling.prompt_logprobs < 0 and r.prompt_index not in gates:
            gates[r.prompt_index] = asyncio.Event()
            r = replace(r, save_prompt_state=True)
        out.append(r)
    return out, gates


async def _opens(pieces: AsyncIterator[Piece], gate: asyncio.Event) -> AsyncGenerator[Piece, None]:
    try:
        async with contextlib.aclosing(pieces) as it:  # type: ignore[type-var]
            async for piece in it:
                gate.set()
                yield piece
    finally:
        gate.set()


async def _after(pieces: AsyncIterator[Piece], gate: asyncio.Event) -> AsyncGenerator[Piece, None]:
    await gate.wait()
    async with contextlib.aclosing(pieces) as it:  # type: ignore[type-var]
        async for piece in it:
            yield piece


async def respond_choices(
    ctx: AppContext,
    reqs: Sequence[PreparedRequest],
    request: Request,
    events: Callable[[AsyncGenerator[tuple[int, Piece], None]], AsyncGenerator[bytes, None]],
    error_for: Callable[[Finish | None], ApiError | None],
    payload: Callable[[list[Accumulated]], Any],
) -> Response:
    """Like native.respond for several requests: `events` gets the merged (position, piece)
    stream, `payload` every choice's output in `reqs` order."""
    holds: list[Reservation] = []
    reqs, gates = share_prompts(ctx, reqs)

    def release_all() -> None:
        for h in holds:
            ctx.in_flight.release(h)

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
        pieces: AsyncIterator[Piece] = generate(ctx.backend, ctx.tok, r, ctx.in_flight, h)
        if (gate := gates.get(r.prompt_index)) is not None:
            pieces = _opens(pieces, gate) if r.save_prompt_state else _after(pieces, gate)
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
