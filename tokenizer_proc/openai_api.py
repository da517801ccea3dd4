"""POST /v1/completions, POST /v1/chat/completions, GET /v1/models (OpenAI schema).

Streaming chunks carry INCREMENTAL text (OpenAI semantics): completions `choices[0].text`,
chat `choices[0].delta.content` (the first chat chunk carries `delta.role`). The last choice
chunk has `finish_reason` "stop" or "length"; with `stream_options.include_usage` a final chunk
with empty `choices` carries `usage`; then `data: [DONE]`. `usage` includes
`prompt_tokens_details.cached_tokens` (prefix-cache hits). A request that fails or is aborted
by the server is HTTP 503 (non-streaming) or an error event before `[DONE]` (streaming).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from tokenizer_proc.context import AppContext, get_ctx
from tokenizer_proc.errors import ApiError
from tokenizer_proc.flow import Accumulated, finish_error, respond
from tokenizer_proc.generation import Finish, Piece
from tokenizer_proc.http_util import json_response, read_body, sse
from tokenizer_proc.prepare import prepare_chat, prepare_completion
from tokenizer_proc.schemas import ChatBody, CompletionBody
from tokenizer_proc.validation import PreparedRequest, decode_body


def openai_error(finish: Finish | None) -> ApiError | None:
    """OpenAI has no abort finish: a request aborted by the server is an error too."""
    return finish_error(finish, abort_is_error=True)


def usage(piece: Piece) -> dict[str, Any]:
    return {
        "prompt_tokens": piece.prompt_tokens,
        "completion_tokens": piece.completion_tokens,
        "total_tokens": piece.prompt_tokens + piece.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": piece.cached_tokens},
    }


def _finish_fields(finish: Finish | None) -> dict[str, Any]:
    if finish is None:
        return {"finish_reason": None}
    return {"finish_reason": finish.reason, "matched_stop": finish.matched}


def _completion_logprobs(ctx: AppContext, ids: list[int], lps: list[float | None]) -> dict[str, Any]:
    tokens = [ctx.tok.token_text(t) for t in ids]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": None, "text_offset": offsets}


def _chat_logprobs(ctx: AppContext, ids: list[int], lps: list[float | None]) -> dict[str, Any]:
    content = [
        {"token": ctx.tok.token_text(t), "logprob": lp, "bytes": ctx.tok.token_bytes(t), "top_logprobs": []}
        for t, lp in zip(ids, lps, strict=False)
    ]
    return {"content": content}


class _Format:
    """Object shapes of one endpoint (completions or chat) for one request."""

    def __init__(self, ctx: AppContext, req: PreparedRequest, chat: bool):
        self.ctx, self.req, self.chat = ctx, req, chat
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.logprobs_fn: Callable[..., dict[str, Any]] = _chat_logprobs if chat else _completion_logprobs

    def envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        obj = self.object + (".chunk" if chunk and self.chat else "")
        return {"id": self.req.rid, "object": obj, "created": self.created, "model": self.ctx.args.model_name,
                "choices": choices}

    def choice(self, text: str, ids: list[int], lps: list[float | None], finish: Finish | None,
               chunk: bool, first: bool = False) -> dict[str, Any]:
        c: dict[str, Any] = {"index": 0}
        if self.chat and chunk:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text or first:
                delta["content"] = text
            c["delta"] = delta
        elif self.chat:
            c["message"] = {"role": "assistant", "content": text}
        else:
            c["text"] = text
        c["logprobs"] = self.logprobs_fn(self.ctx, ids, lps) if self.req.return_logprobs else None
        c.update(_finish_fields(finish))
        return c

    def whole(self, acc: Accumulated) -> dict[str, Any]:
        last = acc.last
        assert last is not None
        body = self.envelope([self.choice("".join(acc.text), acc.ids, acc.logprobs, last.finish, False)], False)
        body["usage"] = usage(last)
        return body


async def _events(fmt: _Format, pieces: AsyncIterator[Piece]) -> AsyncGenerator[bytes, None]:
    first = True
    async for piece in pieces:
        err = openai_error(piece.finish)
        if err is not None:
            yield sse(err.body())
            break
        if not (piece.text or piece.finish or first or fmt.req.return_logprobs):
            continue  # nothing to show yet (bytes of an unfinished character, a stop prefix)
        lps = piece.logprobs or []
        yield sse(fmt.envelope([fmt.choice(piece.text, piece.token_ids, lps, piece.finish, True, first)], True))
        first = False
        if piece.finish is not None and fmt.req.include_usage:
            tail = fmt.envelope([], True)
            tail["usage"] = usage(piece)
            yield sse(tail)


async def _serve(request: Request, chat: bool) -> Response:
    ctx = get_ctx(request)
    data = await read_body(request, ctx.args.max_body_bytes)
    if chat:
        req = await ctx.prepare(prepare_chat, decode_body(data, ChatBody), len(data))
    else:
        req = await ctx.prepare(prepare_completion, decode_body(data, CompletionBody), len(data))
    fmt = _Format(ctx, req, chat)
    return await respond(ctx, req, request, lambda pieces: _events(fmt, pieces), openai_error, fmt.whole)


async def completions_endpoint(request: Request) -> Response:
    return await _serve(request, chat=False)


async def chat_endpoint(request: Request) -> Response:
    return await _serve(request, chat=True)


async def models_endpoint(request: Request) -> Response:
    ctx = get_ctx(request)
    model = {"id": ctx.args.model_name, "object": "model", "created": 0, "owned_by": "hyssm",
             "root": ctx.args.model_path, "max_model_len": ctx.limits.context_length}
    return json_response({"object": "list", "data": [model]})
