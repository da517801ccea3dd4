"""POST /load_lora_adapter and POST /unload_lora_adapter (SGLang's and vLLM's routes and bodies).

Load `{"lora_name": ..., "lora_path": ...}`: the adapter is read and checked here (requests/adapters.py;
a bad one is a 400 with the reader's message), then registered with every scheduler replica (LoadLoraReq),
and only then may requests name it. Unload `{"lora_name": ...}`: requests naming it are refused from now on
(404); those running or waiting finish under it, and the scheduler frees its adapter slot after the last.
Both answer `{"success": true, "message": ...}` once every replica replied; with LoRA off they are a 400
saying `--enable-lora`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from tokenizer_proc.context import AppContext, get_ctx
from tokenizer_proc.http.errors import ApiError, bad_request, unavailable
from tokenizer_proc.http.plumbing import json_response, read_body
from tokenizer_proc.requests.generation import BackendUnavailable

logger = logging.getLogger(__name__)

MAX_BODY = 64 * 1024


async def _body(request: Request, ctx: AppContext, fields: tuple[str, ...]) -> dict[str, Any]:
    ctx.adapters.require_enabled()
    data = await read_body(request, MAX_BODY)
    try:
        body = msgspec.json.decode(data) if data else {}
    except msgspec.DecodeError as e:
        raise bad_request(f"the body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    unknown = sorted(set(body) - set(fields) - {"pinned", "load_inplace"})
    if unknown:
        raise bad_request(f"unknown field(s): {', '.join(unknown)}", unknown[0])
    return body


async def load_lora_endpoint(request: Request) -> Response:
    ctx = get_ctx(request)
    body = await _body(request, ctx, ("lora_name", "lora_path"))
    adapter = await asyncio.to_thread(ctx.adapters.read, body.get("lora_name"), body.get("lora_path"))
    ctx.adapters.begin_load(adapter.name)
    ok, message = False, ""
    try:
        ok, message = await ctx.backend.load_lora(adapter)
    except (BackendUnavailable, TimeoutError) as e:
        raise unavailable(f"the scheduler did not answer: {e}") from e
    finally:
        ctx.adapters.end_load(adapter, ok)
    if not ok:
        raise ApiError(400, f"LoRA adapter {adapter.name!r} not loaded: {message}", "lora_name")
    return json_response({"success": True, "message": f"LoRA adapter {adapter.name!r} loaded",
                          "lora_name": adapter.name, "lora_path": adapter.path})  # fmt: skip


async def unload_lora_endpoint(request: Request) -> Response:
    ctx = get_ctx(request)
    body = await _body(request, ctx, ("lora_name",))
    adapter = ctx.adapters.forget(body.get("lora_name"))
    try:
        ok, message = await ctx.backend.unload_lora(adapter.name)
    except (BackendUnavailable, TimeoutError) as e:
        raise unavailable(f"the scheduler did not answer: {e}") from e
    if not ok:
        logger.warning("unloading LoRA adapter %s: %s", adapter.name, message)
        raise ApiError(400, f"LoRA adapter {adapter.name!r} not unloaded: {message}", "lora_name")
    return json_response({"success": True, "message": f"LoRA adapter {adapter.name!r} unloaded",
                          "lora_name": adapter.name})  # fmt: skip
