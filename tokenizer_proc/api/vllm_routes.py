"""vLLM's GET /load and POST /invocations.

- GET /load -> `{"server_load": n}`: the HTTP requests in flight on the generation routes (LOAD_PATHS), counted
  as vLLM counts its load-aware routes: one per request (not per choice), from its arrival until its response has
  been sent (a streamed one: until its last event), refused ones included while they are answered.
  `ServerLoadMiddleware` owns the count (`AppContext.server_load`); it drops a request just before its last
  body message goes out, so a client that has read a whole response never sees it still counted.
- POST /invocations (SageMaker's route, as vLLM serves it): a body with `messages` is a chat completion, one
  with `prompt` a completion (`messages` wins, as vLLM tries chat first); anything else (embeddings' `input`,
  pooling, scoring) is a 400 naming what the route serves. The answer is that route's, streaming included.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenizer_proc.api.openai_api import serve_openai
from tokenizer_proc.context import AppContext, get_ctx
from tokenizer_proc.http.errors import bad_request
from tokenizer_proc.http.plumbing import json_response, read_body

logger = logging.getLogger(__name__)

LOAD_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/generate", "/invocations"})

INVOCATIONS_SERVED = ("chat completions (a body with `messages`) and completions (a body with `prompt`); "
                      "embeddings, pooling, classification, scoring and reranking are not served")


class ServerLoadMiddleware:
    """Counts the requests on LOAD_PATHS in flight into `ctx.server_load` (pure ASGI: streaming untouched).
    Must hold: every request counted once is released once, whether its response ends, fails or the client goes."""

    def __init__(self, app: ASGIApp, ctx: AppContext) -> None:
        self.app, self.ctx = app, ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in LOAD_PATHS:
            await self.app(scope, receive, send)
            return
        self.ctx.server_load += 1
        counted = [True]

        def release() -> None:
            if counted[0]:
                counted[0] = False
                self.ctx.server_load -= 1

        async def releasing_send(message: Message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                release()
            await send(message)

        try:
            await self.app(scope, receive, releasing_send)
        finally:
            release()


async def load_endpoint(request: Request) -> Response:
    """GET /load (vLLM's): the generation requests in flight (module doc)."""
    return json_response({"server_load": get_ctx(request).server_load})


async def invocations_endpoint(request: Request) -> Response:
    """POST /invocations: the chat or completions answer the body's shape asks for (module doc)."""
    ctx = get_ctx(request)
    data = await read_body(request, ctx.args.max_body_bytes)
    try:  # the top level only: the route decodes the whole body itself
        fields: dict[str, Any] = msgspec.json.decode(data, type=dict[str, msgspec.Raw])
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise bad_request(f"/invocations needs a JSON object body: {e}") from e
    if "messages" in fields:
        return await serve_openai(request, chat=True, data=data)
    if "prompt" in fields:
        return await serve_openai(request, chat=False, data=data)
    raise bad_request(f"Cannot find suitable handler for request: /invocations serves {INVOCATIONS_SERVED}")
