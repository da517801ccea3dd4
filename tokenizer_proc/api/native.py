"""POST /generate, SGLang's native API.

Response: one object of native_format.py (`text`, `output_ids`, `meta_info`). `lora_path` names the LoRA
adapter a prompt runs under (one for all, or a list of one per prompt of a batch: requests/adapters.py).

Streaming (`"stream": true`): server-sent events, each `data: <same object>` with CUMULATIVE
`text` and `output_ids` (like SGLang; the last event's text is the whole output) and
`finish_reason` null until the last one; then `data: [DONE]`. A backend failure is an event
`data: {"error": {...}}` followed by `data: [DONE]`; without streaming it is HTTP 503.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import AsyncGenerator

from starlette.requests import Request
from starlette.responses import Response

from tokenizer_proc.api.native_batch import respond_batch
from tokenizer_proc.api.native_format import error_of, payload
from tokenizer_proc.context import get_ctx
from tokenizer_proc.http.plumbing import read_body, sse
from tokenizer_proc.requests.flow import Accumulated, ended, respond
from tokenizer_proc.requests.generation import Piece
from tokenizer_proc.requests.image_parts import generate_image_refs
from tokenizer_proc.requests.images import load_images
from tokenizer_proc.requests.prepare import PreparedRequest, prepare_batch, prepare_generate
from tokenizer_proc.requests.schemas import GenerateBody
from tokenizer_proc.requests.structured import needs_grammar


def is_batch(body: GenerateBody) -> bool:
    """Whether the body asks for several answers (a batch of prompts, a list of sampling_params, or
    sampling_params.n > 1)."""
    sp = body.sampling_params
    return (isinstance(body.text, list) or any(isinstance(t, list) for t in body.input_ids or [])
            or isinstance(sp, list) or (sp is not None and sp.n != 1))


async def _frames(merged: AsyncGenerator[tuple[int, Piece], None], req: PreparedRequest,
                  started: float) -> AsyncGenerator[bytes, None]:
    """The SSE frames of one /generate request: its object so far after every piece."""
    acc = Accumulated()
    async with contextlib.aclosing(merged) as it:
        async for _, piece in it:
            acc.add(piece)
            err = error_of(piece.finish)
            yield sse(err.body()) if err is not None else sse(payload(req, acc, started))


async def generate_endpoint(request: Request) -> Response:
    ctx = get_ctx(request)
    started = time.monotonic()
    data = await read_body(request, ctx.args.max_body_bytes)
    body = await ctx.decode(data, GenerateBody)
    # each prompt's images are fetched and processed before the response starts
    images = [await load_images(ctx.images, refs) for refs in generate_image_refs(body)]
    if is_batch(body):  # several answers: native_batch.py
        reqs = await ctx.prepare(functools.partial(prepare_batch, images=images), body, len(data),
                                 needs_grammar(body))  # fmt: skip
        loras = ctx.adapters.resolve_each(body.lora_path, max(r.prompt_index for r in reqs) + 1)
        reqs = [dataclasses.replace(r, lora=loras[r.prompt_index]) for r in reqs]
        return await respond_batch(ctx, reqs, request, started)
    req = await ctx.prepare(functools.partial(prepare_generate, images=images[0]), body, len(data),
                            needs_grammar(body))  # fmt: skip
    req = dataclasses.replace(req, lora=ctx.adapters.resolve_each(body.lora_path, 1)[0])
    return await respond(ctx, [req], request, lambda merged: ended(_frames(merged, req, started)), error_of,
                         lambda accs: payload(req, accs[0], started))
