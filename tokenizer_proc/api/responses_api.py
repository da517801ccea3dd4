"""POST /v1/responses, GET and DELETE /v1/responses/{id} (the OpenAI Responses API).

A Responses request is computed as the chat request over its conversation (requests/responses_input.py)
and answered as a `response` object: `output` holds, with --reasoning-parser, a `reasoning` item (one
`reasoning_text` part) when the output reasoned, then one `message` item (an `output_text` part) when
there is text, or when there is nothing else, then one `function_call` item per tool call; `status`
is "completed", or "incomplete" with `incomplete_details.reason` "max_output_tokens" when the output
was cut by `max_output_tokens`. A call the output was cut in (requests/tools.py) is a last
`function_call` item with status "incomplete" and the arguments written so far, as OpenAI gives it
(streamed too), and is part of the stored conversation. Streamed, the events are OpenAI's, each with
its `sequence_number`: response.created, response.in_progress, then for the reasoning
response.output_item.added, response.reasoning_text.delta (as it comes), .reasoning_text.done,
.output_item.done, for the message response.output_item.added, response.content_part.added,
response.output_text.delta (one per piece of text), .output_text.done, .content_part.done,
.output_item.done, then per call .output_item.added, .function_call_arguments.delta / .done,
.output_item.done, and last response.completed (or response.incomplete; response.failed with `error`
when the request failed: its code is "invalid_prompt" where the non-streamed answer is a 4xx, the
request's own fault, else "server_error"). With `store` (the default) the response is kept in the
app's ResponseStore once it is complete (within its bounds in count and bytes: requests/response_store.py).
"""

from __future__ import annotations

import contextlib
import functools
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from tokenizer_proc.api.openai_api import check_model, openai_error, with_adapter
from tokenizer_proc.context import AppContext, get_ctx
from tokenizer_proc.http.errors import ApiError
from tokenizer_proc.http.plumbing import json_response, read_body, sse
from tokenizer_proc.requests.flow import Accumulated, ended, respond
from tokenizer_proc.requests.generation import Finish, Piece
from tokenizer_proc.requests.image_parts import chat_image_refs
from tokenizer_proc.requests.images import load_images
from tokenizer_proc.requests.prepare import PreparedRequest, prepare_chat
from tokenizer_proc.requests.reasoning import ReasoningStream, split_reasoning
from tokenizer_proc.requests.responses_input import chat_body, check_supported, input_messages
from tokenizer_proc.requests.schemas import ChatMessage, FunctionCall, ResponsesBody, ToolCall
from tokenizer_proc.requests.structured import needs_grammar
from tokenizer_proc.requests.tools import parse_output, tool_stream

RESPONSE_ID_PREFIX = "resp_"  # every response id this server issues: resp_ + 32 hex digits (_item_id)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Response:
    """The response object of one request as it is built, and its stream's event numbering."""

    def __init__(self, ctx: AppContext, body: ResponsesBody, req: PreparedRequest,
                 conversation: list[ChatMessage]) -> None:  # fmt: skip
        self.ctx, self.body, self.req = ctx, body, req
        self.conversation = conversation  # before this response's output
        self.id = _item_id(RESPONSE_ID_PREFIX.rstrip("_"))
        self.created = int(time.time())
        self.seq = 0
        self.message_id = _item_id("msg")
        self.reasoning_id = _item_id("rs")
        self.reasoning_text = ""  # the output's reasoning so far (--reasoning-parser)
        self.reasoning_open = False  # streamed: its item was added and is not done yet

    # ------------------------------------------------------------------ objects
    def obj(self, status: str, output: list[dict[str, Any]], last: Piece | None = None,
            error: ApiError | None = None) -> dict[str, Any]:  # fmt: skip
        b = self.body
        fmt = b.text.format if b.text is not None and b.text.format is not None else None
        out: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.ctx.args.model_name, "output": output, "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens, "previous_response_id": b.previous_response_id,
            "parallel_tool_calls": b.parallel_tool_calls, "temperature": b.temperature, "top_p": b.top_p,
            "tool_choice": b.tool_choice if b.tool_choice is not None else "auto",
            "tools": [_tool_echo(t) for t in b.tools or []],
            "text": {"format": _fmt_dict(fmt) if fmt is not None else {"type": "text"}},
            "truncation": b.truncation, "store": b.store, "metadata": b.metadata or {}, "user": b.user,
            "error": None if error is None else {"code": "server_error" if error.status >= 500 else "invalid_prompt",
                                                 "message": error.message},
            "incomplete_details": None, "usage": None,
        }
        if last is not None:
            out["usage"] = {
                "input_tokens": last.prompt_tokens, "output_tokens": last.completion_tokens,
                "total_tokens": last.prompt_tokens + last.completion_tokens,
                # the chat names of the same counts, which SGLang's Responses usage carries too
                "prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
                "input_tokens_details": {"cached_tokens": last.cached_tokens},
                "output_tokens_details": {"reasoning_tokens": len(self.ctx.tok.encode(
                    self.reasoning_text, add_special_tokens=False)) if self.reasoning_text else 0},
            }
            if last.finish is not None and last.finish.reason == "length":
                out["incomplete_details"] = {"reason": "max_output_tokens"}
        return out

    def message(self, text: str, status: str = "completed") -> dict[str, Any]:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        content = [] if status == "in_progress" else [part]
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
        """A call's `function_call` item; "in_progress" has no arguments yet, "incomplete" is a call the
        output was cut in."""
        fn = call["function"]
        return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
                "name": fn["name"], "arguments": "" if status == "in_progress" else fn["arguments"],
                "status": status}  # fmt: skip

    def output(self, content: str | None, calls: list[dict[str, Any]],
               cut: dict[str, Any] | None) -> list[dict[str, Any]]:  # fmt: skip
        items = [self.message(content or "")] if content or not (calls or cut) else []
        return items + [self.call_item(c) for c in calls] + ([self.call_item(cut, "incomplete")] if cut else [])

    def done(self, output: list[dict[str, Any]], content: str | None, calls: list[dict[str, Any]],
             last: Piece | None) -> dict[str, Any]:  # fmt: skip
        """The finished response; stored when asked."""
        finish: Finish | None = last.finish if last is not None else None
        status = "incomplete" if finish is not None and finish.reason == "length" else "completed"
        obj = self.obj(status, output, last)
        if self.body.store:
            reply = ChatMessage(role="assistant", content=content or "", tool_calls=[
                ToolCall(id=c["id"], function=FunctionCall(name=c["function"]["name"],
                                                           arguments=c["function"]["arguments"]))
                for c in calls] or None)  # fmt: skip
            self.ctx.responses.put(self.id, obj, [*self.conversation, reply])
        return obj

    def reasoning_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        content = [] if status == "in_progress" else [{"type": "reasoning_text", "text": text}]
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [], "content": content, "status": status}

    def whole(self, accs: list[Accumulated]) -> dict[str, Any]:
        acc = accs[0]
        reasoning, text = split_reasoning(self.req.reasoning, "".join(acc.text))
        plan, finish = self.req.tool_plan, acc.last.finish if acc.last is not None else None
        cut = finish is not None and finish.reason == "length"
        content, calls, last = parse_output(plan, text, cut) if plan is not None else (text, [], None)
        self.reasoning_text = reasoning or ""
        thought = [self.reasoning_item(reasoning)] if reasoning else []
        answer = self.output(content, calls, last) if content or calls or last or not thought else []
        return self.done(thought + answer, content, calls + [last] if last else calls, acc.last)

    # ------------------------------------------------------------------ stream
    def event(self, kind: str, **fields: Any) -> bytes:
        self.seq += 1
        return sse({"type": kind, "sequence_number": self.seq - 1, **fields})

    async def frames(self, pieces: AsyncGenerator[tuple[int, Piece], None]) -> AsyncGenerator[bytes, None]:
        yield self.event("response.created", response=self.obj("in_progress", []))
        yield self.event("response.in_progress", response=self.obj("in_progress", []))
        stream = tool_stream(self.req.tool_plan) if self.req.tool_plan is not None else None
        thinking = ReasoningStream(self.req.reasoning) if self.req.reasoning is not None else None
        shown: list[str] = []
        output: list[dict[str, Any]] = []  # the finished items
        opened = False
        async with contextlib.aclosing(pieces) as it:
            async for _, piece in it:
                err = openai_error(piece.finish)
                if err is not None:
                    yield self.event("response.failed", response=self.obj("failed", [], error=err))
                    return
                thought, text = thinking.feed(piece.text) if thinking is not None else ("", piece.text)
                if piece.finish is not None and thinking is not None:
                    more_thought, more = thinking.finish()
                    thought, text = thought + more_thought, text + more
                for frame in self._reasoning_events(thought, output, ended=bool(text) or piece.finish is not None):
                    yield frame
                text = stream.feed(text)[0] if stream is not None else text
                calls: list[dict[str, Any]] = []
                last: dict[str, Any] | None = None  # the call a cut output ends in
                if piece.finish is not None and stream is not None:
                    rest, _ = stream.finish(piece.finish.reason == "length")
                    text, calls, last = text + rest, stream.calls(), stream.cut_call()
                where = {"item_id": self.message_id, "output_index": len(output), "content_index": 0}
                # an answer with nothing at all still has its (empty) message, as the whole answer has;
                # one that only reasoned has only its reasoning item
                if not opened and (text or (piece.finish is not None and not calls and not last and not output)):
                    opened = True
                    for frame in self._open_message(len(output)):
                        yield frame
                if text:
                    shown.append(text)
                    yield self.event("response.output_text.delta", **where, delta=text, logprobs=[])
                if piece.finish is None:
                    continue
                content = "".join(shown)
                if opened:
                    item = self.message(content)
                    yield self.event("response.output_text.done", **where, text=content, logprobs=[])
                    yield self.event("response.content_part.done", **where, part=item["content"][0])
                    yield self.event("response.output_item.done", output_index=len(output), item=item)
                    output.append(item)
                for call in calls + [last] if last else calls:
                    status = "incomplete" if call is last else "completed"
                    for frame in self._call_events(call, len(output), status):
                        yield frame
                    output.append(self.call_item(call, status))
                obj = self.done(output, content or None, calls + [last] if last else calls, piece)
                yield self.event("response.completed" if obj["status"] == "completed" else "response.incomplete",
                                 response=obj)  # fmt: skip

    def _reasoning_events(self, thought: str, output: list[dict[str, Any]], ended: bool) -> list[bytes]:
        """The reasoning item's events for a new piece of reasoning (`thought`); `ended`: the reasoning
        is over (content follows, or the output ended), so an open item is closed and put in `output`."""
        frames = []
        where = {"item_id": self.reasoning_id, "output_index": 0, "content_index": 0}
        if thought and not self.reasoning_open and not output:
            self.reasoning_open = True
            frames.append(self.event("response.output_item.added", output_index=0,
                                     item=self.reasoning_item("", "in_progress")))  # fmt: skip
        if thought and self.reasoning_open:
            self.reasoning_text += thought
            frames.append(self.event("response.reasoning_text.delta", **where, delta=thought))
        if ended and self.reasoning_open:
            self.reasoning_open = False
            item = self.reasoning_item(self.reasoning_text)
            frames.append(self.event("response.reasoning_text.done", **where, text=self.reasoning_text))
            frames.append(self.event("response.output_item.done", output_index=0, item=item))
            output.append(item)
        return frames

    def _open_message(self, index: int) -> list[bytes]:
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self.event("response.output_item.added", output_index=index, item=self.message("", "in_progress")),
                self.event("response.content_part.added", item_id=self.message_id, output_index=index,
                           content_index=0, part=part)]  # fmt: skip

    def _call_events(self, call: dict[str, Any], index: int, status: str) -> list[bytes]:
        item = self.call_item(call, status)
        args = call["function"]["arguments"]
        return [
            self.event("response.output_item.added", output_index=index, item=self.call_item(call, "in_progress")),
            self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=args),
            self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                       arguments=args, name=item["name"]),
            self.event("response.output_item.done", output_index=index, item=item),
        ]


def _fmt_dict(fmt: Any) -> dict[str, Any]:
    return {k: getattr(fmt, k) for k in fmt.__struct_fields__ if getattr(fmt, k) is not None}


def _tool_echo(tool: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "name": tool.get("name"), "description": tool.get("description"),
            "parameters": tool.get("parameters"), "strict": tool.get("strict")}


def _stored(ctx: AppContext, rid: str, param: str) -> Any:
    """The stored response `rid` names. An id not of the form this server issues (`resp_...`) is a 400
    naming `param` (OpenAI's and the peers' wording); a well-formed id that is not kept is a 404."""
    if not rid.startswith(RESPONSE_ID_PREFIX):
        raise ApiError(400, f"Invalid '{param}': {rid!r}. Expected an ID that begins with 'resp'.", param)
    entry = ctx.responses.get(rid)
    if entry is None:
        store = ctx.responses
        raise ApiError(404, f"no stored response with id {rid!r} (responses are kept in memory: at most the "
                       f"{store.capacity} most recently used, and at most {store.max_bytes} bytes of them as JSON)",
                       param, err_type="not_found_error")  # fmt: skip
    return entry


async def responses_endpoint(request: Request) -> Response:
    ctx = get_ctx(request)
    data = await read_body(request, ctx.args.max_body_bytes)
    body = await ctx.decode(data, ResponsesBody)
    lora = check_model(ctx, body.model)
    check_supported(body)
    history = list(_stored(ctx, body.previous_response_id, "previous_response_id").conversation) \
        if body.previous_response_id else []  # fmt: skip
    own = await ctx.offload(len(data), input_messages, body)
    chat = await ctx.offload(len(data), chat_body, body, history + own)
    images = await load_images(ctx.images, chat_image_refs(chat.messages))
    reqs = with_adapter(await ctx.prepare(functools.partial(prepare_chat, images=images), chat, len(data),
                                          needs_grammar(chat)), lora)  # fmt: skip
    carried = own[1:] if body.instructions else own  # instructions are not carried over
    resp = _Response(ctx, body, reqs[0], history + carried)
    return await respond(ctx, reqs, request, lambda pieces: ended(resp.frames(pieces)), openai_error, resp.whole)


async def response_endpoint(request: Request) -> Response:
    """GET /v1/responses/{id}: a stored response; DELETE removes it."""
    ctx = get_ctx(request)
    rid = request.path_params["response_id"]
    if request.method == "DELETE":
        _stored(ctx, rid, "response_id")
        ctx.responses.delete(rid)
        return json_response({"id": rid, "object": "response.deleted", "deleted": True})
    return json_response(_stored(ctx, rid, "response_id").response)
