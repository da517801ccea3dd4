"""POST /v1/completions, POST /v1/chat/completions, GET /v1/models[/{id}] (OpenAI schema).

A response has one choice per prepared request (`n` per prompt, indexed prompt_index * n + i).
Streaming chunks carry INCREMENTAL text (OpenAI semantics) of one choice each: completions
`choices[0].text` (with echo the first chunk of a choice starts with the prompt), chat
`choices[0].delta.content` (the first chunk of each choice carries `delta.role`). A choice's last
chunk has `finish_reason` "stop" or "length" ("tool_calls" for a chat output that made calls and
ended by itself; one cut by the token limit stays "length": requests/tools.py); with
`stream_options.include_usage` a final chunk with empty `choices` carries `usage` (each prompt counted
once) after every choice finished; then `data: [DONE]`. A request naming another model is a 404.
`usage` includes `prompt_tokens_details.cached_tokens` (prefix-cache hits). With `use_beam_search` the
choices are the n best beams of each prompt, best first (requests/beam_search.py; streamed, each beam
comes whole once the search ends, as vLLM streams it).
A request that fails or is aborted by the server is HTTP 503 (non-streaming) or an error event before
`[DONE]` (streaming). vLLM's extra answer fields (token ids, prompt logprobs, continuous usage) are placed by
openai_extras.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import AsyncGenerator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from tokenizer_proc.api.logprobs import CompletionLogprobs, chat_logprobs, merge_completion
from tokenizer_proc.api.openai_extras import choice_fields, chunk_fields, prompt_fields
from tokenizer_proc.context import AppContext, get_ctx
from tokenizer_proc.http.errors import ApiError
from tokenizer_proc.http.plumbing import (
    ClientGoneResponse,
    SSEResponse,
    json_response,
    read_body,
    run_unless_disconnected,
    sse,
)
from tokenizer_proc.requests import beam_search
from tokenizer_proc.requests.chat_output import ChoiceStream, message
from tokenizer_proc.requests.flow import Accumulated, ended, finish_error, respond
from tokenizer_proc.requests.generation import Finish, Piece
from tokenizer_proc.requests.image_parts import chat_image_refs
from tokenizer_proc.requests.images import load_images
from tokenizer_proc.requests.prepare import PreparedRequest, prepare_chat, prepare_completion
from tokenizer_proc.requests.schemas import ChatBody, CompletionBody
from tokenizer_proc.requests.structured import needs_grammar


def openai_error(finish: Finish | None) -> ApiError | None:
    """OpenAI has no abort finish: a request aborted by the server is an error too."""
    return finish_error(finish, abort_is_error=True)


def _finish_fields(finish: Finish | None) -> dict[str, Any]:
    if finish is None:
        return {"finish_reason": None}
    return {"finish_reason": finish.reason, "matched_stop": finish.matched}


class _Format:
    """Object shapes of one endpoint (completions or chat) for the choices of one request, and the
    per-choice streaming state (first chunk sent, logprob text offsets)."""

    def __init__(self, ctx: AppContext, reqs: list[PreparedRequest], chat: bool):
        self.ctx, self.reqs, self.chat = ctx, reqs, chat
        self.req = reqs[0]
        # the response id: the rid of a single choice, else the rid the choices' rids extend
        self.id = self.req.rid if len(reqs) == 1 else self.req.rid.rsplit("-", 1)[0]
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.started = [False] * len(reqs)
        self.lp = [CompletionLogprobs(ctx.tok, r.sampling.top_logprobs) for r in reqs]
        self.streams = [ChoiceStream(r) for r in reqs] if chat else []

    def envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        obj = self.object + (".chunk" if chunk and self.chat else "")
        model = self.req.lora or self.ctx.args.model_name  # an adapter's answers name it, as vLLM's do
        return {"id": self.id, "object": obj, "created": self.created, "model": model, "choices": choices}

    def _logprobs(self, pos: int, acc: Accumulated | Piece, first: bool) -> dict[str, Any] | None:
        req = self.reqs[pos]
        if not req.return_logprobs:
            return None
        ids, lps = list(acc.ids if isinstance(acc, Accumulated) else acc.token_ids), acc.logprobs or []
        tops = acc.top_logprobs if req.sampling.top_logprobs else None
        if req.echo_only:
            ids, lps, tops = [], [], None
        if self.chat:
            return chat_logprobs(self.ctx.tok, ids, lps, tops)
        parts = []
        if first and req.echo is not None:
            parts.append(self.lp[pos].prompt(req.input_ids, acc.prompt_logprobs, acc.prompt_top_logprobs))
        parts.append(self.lp[pos].chunk(ids, lps, tops))
        return merge_completion(parts)

    def choice(self, pos: int, text: str, acc: Accumulated | Piece, finish: Finish | None,
               chunk: bool) -> dict[str, Any]:
        req = self.reqs[pos]
        first = not self.started[pos]
        self.started[pos] = True
        c: dict[str, Any] = {"index": req.index}
        called, cut = False, finish is not None and finish.reason == "length"
        if self.chat and chunk:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            stream = self.streams[pos]
            delta.update(stream.feed(text, finish is not None, cut))
            if first and "content" not in delta:
                delta["content"] = ""
            called = finish is not None and stream.called
            c["delta"] = delta
        elif self.chat:
            c["message"] = message(req, text, cut)
            called = "tool_calls" in c["message"]
        else:
            text = "" if req.echo_only else text
            c["text"] = (req.echo or "") + text if first else text
        c["logprobs"] = self._logprobs(pos, acc, first)
        c.update(_finish_fields(finish))
        if req.echo_only and finish is not None and finish.reason in ("stop", "length"):
            c["finish_reason"], c["matched_stop"] = "length", None
        if called and finish is not None and finish.reason == "stop":  # a cut output stays "length" (tools.py)
            c["finish_reason"] = "tool_calls"
        c.update(choice_fields(self.ctx.tok, req, acc, first, self.chat))
        return c

    def usage(self, lasts: list[Piece]) -> dict[str, Any]:
        """Usage over every choice: each prompt counted once, every choice's completion tokens."""
        prompts: dict[int, tuple[int, int]] = {}
        for req, p in zip(self.reqs, lasts, strict=True):
            seen = prompts.get(req.prompt_index, (0, 0))[1]
            prompts[req.prompt_index] = (p.prompt_tokens, max(p.cached_tokens, seen))
        prompt = sum(n for n, _ in prompts.values())
        completion = sum(0 if r.echo_only else p.completion_tokens for r, p in zip(self.reqs, lasts, strict=True))
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(c for _, c in prompts.values())}}

    def _best(self, accs: list[Accumulated]) -> list[tuple[int, int]]:
        """(position, returned index) of the choices returned: all of them, or with best_of > n the
        `keep` of each prompt with the highest sum of logprobs, indexed prompt_index * keep + rank."""
        if not self.req.keep:
            return [(pos, r.index) for pos, r in enumerate(self.reqs)]
        by_prompt: dict[int, list[int]] = {}
        for pos, r in enumerate(self.reqs):
            by_prompt.setdefault(r.prompt_index, []).append(pos)
        out = []
        for pi, positions in by_prompt.items():
            ranked = sorted(positions, key=lambda p: -sum(lp for lp in accs[p].logprobs if lp is not None))
            out += [(p, pi * self.req.keep + rank) for rank, p in enumerate(ranked[: self.req.keep])]
        return out

    def whole(self, accs: list[Accumulated]) -> dict[str, Any]:
        choices = []
        for pos, index in self._best(accs):
            acc = accs[pos]
            assert acc.last is not None
            c = self.choice(pos, "".join(acc.text), acc, acc.last.finish, False)
            if not self.chat:  # vLLM's answer has the field, null unless asked for: its clients read it
                c.setdefault("prompt_logprobs", None)
            choices.append({**c, "index": index})
        body = self.envelope(sorted(choices, key=lambda c: c["index"]), False)
        body["usage"] = self.usage([a.last for a in accs if a.last is not None])
        if self.chat:
            body.update({"prompt_logprobs": None, **prompt_fields(self.ctx.tok, self.req, accs[0])})
        return body


def _events(fmt: _Format, pieces: AsyncGenerator[tuple[int, Piece], None]) -> AsyncGenerator[bytes, None]:
    return ended(_frames(fmt, pieces))


async def _frames(fmt: _Format, pieces: AsyncGenerator[tuple[int, Piece], None]) -> AsyncGenerator[bytes, None]:
    lasts: dict[int, Piece] = {}
    async with contextlib.aclosing(pieces) as it:
        async for pos, piece in it:
            err = openai_error(piece.finish)
            if err is not None:
                yield sse(err.body())
                break
            first, req = not fmt.started[pos], fmt.reqs[pos]
            if not (piece.text or piece.finish or first or req.return_logprobs or req.return_token_ids):
                continue  # nothing to show yet (bytes of an unfinished character, a stop prefix)
            choice = fmt.choice(pos, piece.text, piece, piece.finish, True)
            news = (not fmt.chat or choice["delta"] or choice["finish_reason"] or choice["logprobs"]
                    or choice.get("token_ids"))
            if news:  # a tool call being held back sends nothing until it is complete
                yield sse({**fmt.envelope([choice], True), **chunk_fields(fmt.ctx.tok, req, piece, first, fmt.chat)})
            if piece.finish is not None:
                lasts[pos] = piece
                if len(lasts) == len(fmt.reqs) and fmt.req.include_usage:
                    tail = fmt.envelope([], True)
                    tail["usage"] = fmt.usage([lasts[i] for i in range(len(fmt.reqs))])
                    yield sse(tail)


def check_model(ctx: AppContext, model: str | None, lora_path: Any = None) -> str:
    """The LoRA adapter a request runs under ("" = the base model): the one its `model` names (vLLM), or with
    `model` the base model's, SGLang's `lora_path`. A model this server does not serve is a 404 (OpenAI's
    model_not_found); `lora_path` naming another adapter than `model` is a 400."""
    base = model is None or model in (ctx.args.model_name, ctx.args.model_path)
    named = ctx.adapters.resolve(lora_path, "lora_path")
    if base:
        return named
    if model in ctx.adapters.adapters:
        if named and named != model:
            raise ApiError(400, f"model {model!r} and lora_path {named!r} name different adapters", "lora_path")
        return model  # type: ignore[return-value]
    served = ", ".join(repr(n) for n in [ctx.args.model_name, *ctx.adapters.adapters])
    raise ApiError(404, f"the model {model!r} does not exist; this server serves {served}", "model",
                   err_type="not_found_error")


def with_adapter(reqs: list[PreparedRequest], lora: str) -> list[PreparedRequest]:
    """The requests, each run under the adapter `lora` ("" = the base model)."""
    return [dataclasses.replace(r, lora=lora) for r in reqs] if lora else reqs


async def serve_openai(request: Request, chat: bool, data: bytes | None = None) -> Response:
    """The chat (`chat`) or completions answer of `request`, whose body is `data` when it was read already
    (POST /invocations reads it to choose)."""
    ctx = get_ctx(request)
    if data is None:
        data = await read_body(request, ctx.args.max_body_bytes)
    body: ChatBody | CompletionBody = await ctx.decode(data, ChatBody if chat else CompletionBody)
    lora = check_model(ctx, body.model, body.lora_path)
    prepare: Any = prepare_completion
    if isinstance(body, ChatBody):  # its images are fetched and processed before the response starts
        images = await load_images(ctx.images, chat_image_refs(body.messages))
        prepare = functools.partial(prepare_chat, images=images)
    reqs = with_adapter(await ctx.prepare(prepare, body, len(data), needs_grammar(body)), lora)
    if body.use_beam_search:
        return await _serve_beams(ctx, reqs, request, chat, body.n, body.length_penalty)
    fmt = _Format(ctx, reqs, chat)
    return await respond(ctx, reqs, request, lambda pieces: _events(fmt, pieces), openai_error, fmt.whole)


async def _serve_beams(ctx: AppContext, reqs: list[PreparedRequest], request: Request, chat: bool, width: int,
                       length_penalty: float | None) -> Response:  # fmt: skip
    """A beam-search request (requests/beam_search.py): the n best beams of each prompt as its choices, streamed
    (each beam whole once the search ends, as vLLM streams it) or not."""
    penalty = 1.0 if length_penalty is None else length_penalty
    holds = await beam_search.admit(ctx, reqs)
    if reqs[0].stream:
        pieces = beam_search.streamed(ctx, reqs, width, penalty)
        return SSEResponse(_events(_Format(ctx, reqs, chat), pieces),  # type: ignore[return-value]
                           on_close=functools.partial(beam_search.release, ctx, holds))  # fmt: skip
    try:
        completed, out = await run_unless_disconnected(beam_search.run(ctx, reqs, width, penalty), request)
    finally:
        beam_search.release(ctx, holds)
    if not completed or out is None:
        return ClientGoneResponse()
    return json_response(_Format(ctx, [reqs[pos] for pos, _ in out], chat).whole([acc for _, acc in out]))


async def completions_endpoint(request: Request) -> Response:
    return await serve_openai(request, chat=False)


async def chat_endpoint(request: Request) -> Response:
    return await serve_openai(request, chat=True)


def _model_card(ctx: AppContext, lora: str = "") -> dict[str, Any]:
    """The base model's card, or a LoRA adapter's (vLLM's: `parent` the base model, `root` its directory)."""
    if lora:
        return {"id": lora, "object": "model", "created": 0, "owned_by": "hyssm",
                "root": ctx.adapters.adapters[lora].path, "parent": ctx.args.model_name,
                "max_model_len": ctx.limits.context_length}  # fmt: skip
    return {"id": ctx.args.model_name, "object": "model", "created": 0, "owned_by": "hyssm",
            "root": ctx.args.resolved_model_path, "parent": None, "max_model_len": ctx.limits.context_length}


async def models_endpoint(request: Request) -> Response:
    """GET /v1/models: the base model, then every LoRA adapter."""
    ctx = get_ctx(request)
    cards = [_model_card(ctx)] + [_model_card(ctx, name) for name in ctx.adapters.adapters]
    return json_response({"object": "list", "data": cards})


async def model_endpoint(request: Request) -> Response:
    """GET /v1/models/{id}: the model's or adapter's card, or 404 for a model this server does not serve."""
    ctx = get_ctx(request)
    return json_response(_model_card(ctx, check_model(ctx, request.path_params["model_id"])))
