"""POST /generate, SGLang's native API.

Response: `{"text", "output_ids", "meta_info": {"id", "prompt_tokens", "completion_tokens",
"cached_tokens", "finish_reason", "e2e_latency"}}`; finish_reason is `{"type": "stop", "matched":
<token id or stop string>}`, `{"type": "length", "length": N}` or `{"type": "abort", "message": ...}`.
With `return_logprob`, `meta_info.output_token_logprobs` is `[[logprob, token_id, null], ...]`.

Streaming (`"stream": true`): server-sent events, each `data: <same object>` with CUMULATIVE
`text` and `output_ids` (like SGLang; the last event's text is the whole output) and
`finish_reason` null until the last one; then `data: [DONE]`. A backend failure is an event
`data: {"error": {...}}` followed by `data: [DONE]`; without streaming it is HTTP 503.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from tokenizer_proc.context import AppContext, get_ctx
from tokenizer_proc.errors import ApiError, internal_error, unavailable
from tokenizer_proc.generation import BackendUnavailable, Finish, Piece, generate, precheck
from tokenizer_proc.http_util import (
    SSE_DONE,
    ClientGoneResponse,
    SSEResponse,
    json_response,
    read_body,
    run_unless_disconnected,
    sse,
)
from tokenizer_proc.prepare import prepare_generate
from tokenizer_proc.schemas import GenerateBody
from tokenizer_proc.structured import needs_grammar
from tokenizer_proc.validation import PreparedRequest, decode_body


@dataclass
class Accumulated:
    """The output of one request so far (owned by its handler)."""

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


async def collect(pieces: AsyncIterator[Piece]) -> Accumulated:
    acc = Accumulated()
    async with contextlib.aclosing(pieces) as it:  # type: ignore[type-var]
        async for piece in it:
            acc.add(piece)
    return acc


def native_finish(finish: Finish | None, completion_tokens: int) -> dict[str, Any] | None:
    if finish is None:
        return None
    if finish.reason == "length":
        return {"type": "length", "length": completion_tokens}
    if finish.reason == "stop":
        return {"type": "stop", "matched": finish.matched}
    return {"type": finish.reason, "message": finish.message}


def _payload(req: PreparedRequest, acc: Accumulated, started: float) -> dict[str, Any]:
    last = acc.last
    assert last is not None
    meta: dict[str, Any] = {
        "id": req.rid,
        "prompt_tokens": last.prompt_tokens,
        "completion_tokens": last.completion_tokens,
        "cached_tokens": last.cached_tokens,
        "finish_reason": native_finish(last.finish, last.completion_tokens),
        "e2e_latency": time.monotonic() - started,
    }
    if req.return_logprobs:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(acc.logprobs, acc.ids, strict=False)]
        if req.sampling.top_logprobs:
            meta["output_top_logprobs"] = [[[v, a, None] for a, v in top] for top in acc.top_logprobs]
        if acc.prompt_logprobs is not None:
            meta["input_token_logprobs"] = _input_logprobs(req, acc)
    return {"text": "".join(acc.text), "output_ids": list(acc.ids), "meta_info": meta}


def _input_logprobs(req: PreparedRequest, acc: Accumulated) -> list[list[Any]]:
    """SGLang's input_token_logprobs: [logprob, token id, null] from logprob_start_len on (the
    first prompt token has logprob null)."""
    lps = [None, *(acc.prompt_logprobs or [])]
    rows = [[lp, t, None] for lp, t in zip(lps, req.input_ids, strict=False)]
    return rows[req.logprob_start_len:]


def is_batch(body: GenerateBody) -> bool:
    """Whether the body asks for several answers (a batch of prompts, or sampling_params.n > 1)."""
    sp = body.sampling_params
    return (isinstance(body.text, list) or any(isinstance(t, list) for t in body.input_ids or [])
            or (sp is not None and sp.n != 1))


def error_of(finish: Finish | None) -> ApiError | None:
    """Backend failures become errors (abort is a normal finish on the native API)."""
    if finish is not None and finish.reason == "rejected":
        return ApiError(400, finish.message or "the request can never run on this server")
    if finish is not None and finish.reason == "error":
        return unavailable(finish.message or "the request failed")
    return None


async def _events(pieces: AsyncIterator[Piece], req: PreparedRequest, started: float) -> AsyncGenerator[bytes, None]:
    acc = Accumulated()
    try:
        async with contextlib.aclosing(pieces) as it:  # type: ignore[type-var]
            async for piece in it:
                acc.add(piece)
                err = error_of(piece.finish)
                yield sse(err.body()) if err is not None else sse(_payload(req, acc, started))
    except BackendUnavailable as e:
        yield sse(unavailable(str(e)).body())
    except ApiError as e:
        yield sse(e.body())
    except Exception as e:  # noqa: BLE001 - a stream always ends with an error event and [DONE]
        yield sse(internal_error(e).body())
    yield SSE_DONE


async def generate_endpoint(request: Request) -> Response:
    ctx = get_ctx(request)
    started = time.monotonic()
    data = await read_body(request, ctx.args.max_body_bytes)
    body = decode_body(data, GenerateBody)
    if is_batch(body):  # several answers: native_batch.py
        from tokenizer_proc.native_batch import prepare_batch, respond_batch

        reqs = await ctx.prepare(prepare_batch, body, len(data), needs_grammar(body))
        return await respond_batch(ctx, reqs, request, started)
    req = await ctx.prepare(prepare_generate, body, len(data), needs_grammar(body))
    return await respond(
        ctx, req, request, lambda pieces: _events(pieces, req, started), error_of,
        lambda acc: _payload(req, acc, started),
    )


async def respond(
    ctx: AppContext,
    req: PreparedRequest,
    request: Request,
    events: Callable[[AsyncIterator[Piece]], AsyncGenerator[bytes, None]],
    error_for: Callable[[Finish | None], ApiError | None],
    payload: Callable[[Accumulated], Any],
) -> Response:
    """The request/response flow every generation endpoint shares: admission precheck, then
    either an SSE stream of `events`, or the whole output collected (a client that leaves is
    aborted) and answered with `payload`, or the error `error_for` makes of its finish."""
    try:
        hold = precheck(ctx.backend, req, ctx.in_flight)
    except BackendUnavailable as e:
        raise unavailable(str(e)) from e
    pieces = ctx.latency.timed(generate(ctx.backend, ctx.tok, req, ctx.in_flight, hold))
    if req.stream:
        return SSEResponse(events(pieces), on_close=lambda: ctx.in_flight.release(hold))  # type: ignore[return-value]
    try:
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
