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

import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from tokenizer_proc.context import get_ctx
from tokenizer_proc.errors import ApiError
from tokenizer_proc.flow import Accumulated, finish_error, respond
from tokenizer_proc.generation import Finish, Piece
from tokenizer_proc.http_util import (
    read_body,
    sse,
)
from tokenizer_proc.prepare import prepare_generate
from tokenizer_proc.schemas import GenerateBody
from tokenizer_proc.structured import needs_grammar
from tokenizer_proc.validation import PreparedRequest, decode_body


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
    return finish_error(finish, abort_is_error=False)


async def _events(pieces: AsyncIterator[Piece], req: PreparedRequest, started: float) -> AsyncGenerator[bytes, None]:
    """The SSE frames of /generate (flow.respond ends the stream with [DONE] and turns failures
    into one error event)."""
    acc = Accumulated()
    async for piece in pieces:
        acc.add(piece)
        err = error_of(piece.finish)
        yield sse(err.body()) if err is not None else sse(_payload(req, acc, started))


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
