"""Tool calling: parsing of each family's call format, the streamed hold-back of a call, the
tool_choice plans and their grammars, templates given tools and tool_calls, and the HTTP shapes
(message.tool_calls, finish_reason, streamed tool-call deltas) over a fake backend, also for an output
cut by the token limit (finish_reason "length", the cut call last; in the Responses API an "incomplete"
function_call item)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest

from shared.config import ServerArgs
from tests.tokenizer.conftest import FakeBackend, text_plan, write_model_dir
from tests.tokenizer.test_app import serve, sse_events
from tokenizer_proc.requests.schemas import ChatBody
from tokenizer_proc.requests.tool_parsers import parse_calls
from tokenizer_proc.requests.tools import ToolPlan, parse_output, plan_tools, tool_stream
from tokenizer_proc.requests.validation import decode_body

CHAT = "/v1/chat/completions"
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}
NOOP = {"type": "function", "function": {"name": "noop"}}
MSGS = [{"role": "user", "content": "hi"}]


def _body(**kw: Any) -> ChatBody:
    return decode_body(json.dumps({"messages": MSGS, **kw}).encode(), ChatBody)


@pytest.mark.parametrize(("text", "content", "calls"), [
    ('<tool_call>{"name": "weather", "arguments": {"city": "Rome"}}</tool_call>', None,
     [("weather", {"city": "Rome"})]),
    ('Sure. <tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "parameters": {"x": 1}}'
     '</tool_call>', "Sure.", [("a", {}), ("b", {"x": 1})]),
    ('<|tool_call|>[{"name": "a", "arguments": {"k": "v"}}]', None, [("a", {"k": "v"})]),
    ('<TOOLCALL>[{"name": "n", "arguments": {}}]</TOOLCALL> done', "done", [("n", {})]),
    ("no calls here", "no calls here", []),
    ('<tool_call>{"name": broken</tool_call>', '<tool_call>{"name": broken</tool_call>', []),
])
def test_parse_tagged_formats(text: str, content: str | None, calls: list[tuple[str, dict]]) -> None:
    got_content, got = parse_calls("auto", text, {})
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got)


def test_stream_holds_back_a_possible_call() -> None:
    ts = tool_stream(ToolPlan("auto"))
    out = [ts.feed(p) for p in ["Hello <", "tool", "_call>", '{"name": "x", "arguments": {}}', "</tool_call>"]]
    assert [content for content, _ in out] == ["Hello ", "", "", "", ""]
    content, _ = ts.finish()
    assert content == "" and [c["function"]["name"] for c in ts.calls()] == ["x"]
    ts = tool_stream(ToolPlan("auto"))
    assert [ts.feed(t)[0] for t in ("a <b", " <to", "x")] == ["a <b", " ", "<tox"] and ts.finish() == ("", [])


def test_plans_and_their_grammars() -> None:
    assert plan_tools(_body()).mode == "" and plan_tools(_body(tools=[WEATHER])).mode == "auto"
    assert plan_tools(_body(tools=[WEATHER], tool_choice="none")).mode == ""
    assert plan_tools(_body(tools=[WEATHER], tool_choice="none")).template_tools == [WEATHER]
    req = plan_tools(_body(tools=[WEATHER, NOOP], tool_choice="required", parallel_tool_calls=False))
    assert req.mode == "required" and req.grammar is not None
    schema = json.loads(req.grammar.source)
    jsonschema.validate([{"name": "weather", "arguments": {"city": "Paris"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "weather", "arguments": {"city": "Oslo"}}], schema)
    with pytest.raises(jsonschema.ValidationError):  # one call only without parallel_tool_calls
        jsonschema.validate([{"name": "noop", "arguments": {}}] * 2, schema)
    named = plan_tools(_body(tools=[WEATHER, NOOP], tool_choice={"type": "function", "function": {"name": "weather"}}))
    assert named.mode == "named" and json.loads(named.grammar.source) == WEATHER["function"]["parameters"]
    content, calls, _ = parse_output(named, '{"city": "Rome"}')
    assert content is None and calls[0]["function"] == {"name": "weather", "arguments": '{"city": "Rome"}'}
    content, calls, _ = parse_output(req, '[{"name": "noop", "arguments": {}}]')
    assert content is None and calls[0]["function"]["name"] == "noop"
    assert parse_output(req, '[{"name": "noop", "argu') == ('[{"name": "noop", "argu', [], None)
    content, calls, _ = parse_output(req, '[{"name": "noop", "arguments": {}}, {"name": "weather", "argu')
    assert content is None and [c["function"]["name"] for c in calls] == ["noop"]  # the complete call is kept


def test_template_gets_tools_and_history(tok) -> None:
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]
    text = tok.render_chat(messages, tools=[WEATHER])
    assert '"name": "weather"' in text.split("</tools>")[0]
    assert '<tool_call>{"name": "weather", "arguments": {"city": "Rome"}}</tool_call>' in text
    assert "<|start_of_role|>tool<|end_of_role|>sunny" in text
    assert tok.render_chat(messages[:1]) == tok.render_chat(messages[:1], tools=None)
    assert "<tools>" not in tok.render_chat(messages[:1])


CALL = '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture
def long_args(tmp_path) -> ServerArgs:
    """A model with room for the tools prompt."""
    return ServerArgs(model_path=write_model_dir(str(tmp_path), context=2048), max_new_tokens_limit=128)


def test_http_auto_calls_whole_and_streamed(long_args, tok) -> None:
    backend = FakeBackend(plan=text_plan("ok " + CALL, per_out=4, stop=True))
    n = len(("ok " + CALL).encode()) + 1

    async def check(c: httpx.AsyncClient) -> None:
        body = {"messages": MSGS, "tools": [WEATHER], "max_tokens": n}
        r = (await c.post(CHAT, json=body)).json()
        (ch,) = r["choices"]
        assert ch["finish_reason"] == "tool_calls" and ch["message"]["content"] == "ok"
        (call,) = ch["message"]["tool_calls"]
        assert call["function"]["name"] == "weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
        r = await c.post(CHAT, json={**body, "stream": True})
        events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
        deltas = [e["choices"][0]["delta"] for e in events]
        assert "".join(d.get("content", "") for d in deltas) == "ok "
        calls = [part for d in deltas for part in d.get("tool_calls", [])]
        head, *fragments = calls  # the id and name first, then the arguments as they come
        assert head["index"] == 0 and head["function"]["name"] == "weather" and head["id"]
        assert len(fragments) > 1 and all(f["index"] == 0 and set(f["function"]) == {"arguments"} for f in fragments)
        assert "".join(f["function"]["arguments"] for f in calls) == call["function"]["arguments"]
        per_delta = [d["tool_calls"] for d in deltas if "tool_calls" in d]
        assert all(len({p["index"] for p in parts}) == len(parts) for parts in per_delta)  # one entry per call
        assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
        r = (await c.post(CHAT, json={**body, "tool_choice": "none"})).json()
        assert r["choices"][0]["message"]["content"].startswith("ok <tool_call>")
        assert "tool_calls" not in r["choices"][0]["message"] and r["choices"][0]["finish_reason"] == "stop"

    serve(long_args, backend, tok, check)
    assert all(s.sampling.grammar is None for s in backend.submitted)


def test_http_named_choice_is_constrained(long_args, tok) -> None:
    backend = FakeBackend(plan=text_plan('{"city": "Rome"}', per_out=3))

    async def check(c: httpx.AsyncClient) -> None:
        r = (await c.post(CHAT, json={"messages": MSGS, "tools": [WEATHER], "max_tokens": 16,
                                      "tool_choice": {"type": "function", "function": {"name": "weather"}}})).json()
        (call,) = r["choices"][0]["message"]["tool_calls"]
        assert call["function"] == {"name": "weather", "arguments": '{"city": "Rome"}'}
        assert r["choices"][0]["message"]["content"] is None

    serve(long_args, backend, tok, check)
    (sub,) = backend.submitted
    assert sub.sampling.grammar is not None and sub.sampling.grammar.kind == "json_schema"


def _streamed_calls(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calls a streamed chat answer adds up to (OpenAI's deltas: id and name first, then fragments)."""
    calls: list[dict[str, Any]] = []
    for e in events:
        for part in (e["choices"][0]["delta"].get("tool_calls") or []) if e["choices"] else []:
            if part["index"] == len(calls):
                calls.append({"id": part["id"], "type": "function", "function": {**part["function"]}})
            else:
                calls[part["index"]]["function"]["arguments"] += part["function"]["arguments"]
    return calls


CUT = {  # tool_choice: (an output cut by max_tokens, its complete calls and cut call as (name, arguments))
    "auto": ('<tool_call>{"name": "noop", "arguments": {}}</tool_call>\n<tool_call>{"name": "weather", '
             '"arguments": {"city": "Ro', [("noop", "{}"), ("weather", '{"city": "Ro')]),
    "required": ('[{"name": "noop", "arguments": {}}, {"name": "weather", "arguments": {"ci',
                 [("noop", "{}"), ("weather", '{"ci')]),
    "named": ('{"city": "Pa', [("weather", '{"city": "Pa')]),
}  # fmt: skip


@pytest.mark.parametrize("choice", list(CUT))
def test_http_a_call_cut_by_max_tokens_finishes_with_length(long_args, tok, choice: str) -> None:
    text, want = CUT[choice]
    backend = FakeBackend(plan=text_plan(text, per_out=3))
    tool_choice = {"type": "function", "function": {"name": "weather"}} if choice == "named" else choice

    async def check(c: httpx.AsyncClient) -> None:
        body = {"messages": MSGS, "tools": [NOOP, WEATHER], "max_tokens": len(text.encode()),
                "tool_choice": tool_choice}
        (ch,) = (await c.post(CHAT, json=body)).json()["choices"]
        assert ch["finish_reason"] == "length" and ch["message"]["content"] is None
        calls = ch["message"]["tool_calls"]
        assert [(t["function"]["name"], t["function"]["arguments"]) for t in calls] == want
        assert all(t["id"].startswith("call_") for t in calls)
        events = sse_events((await c.post(CHAT, json={**body, "stream": True})).text)
        assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
        streamed = _streamed_calls(events)
        assert [(t["function"]["name"], t["function"]["arguments"]) for t in streamed] == want
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == ""

    serve(long_args, backend, tok, check)


def test_http_responses_a_call_cut_by_max_output_tokens_is_incomplete(long_args, tok) -> None:
    text, want = CUT["required"]
    backend = FakeBackend(plan=text_plan(text, per_out=3))
    tools = [{"type": "function", **t["function"]} for t in (NOOP, WEATHER)]

    async def check(c: httpx.AsyncClient) -> None:
        body = {"input": "hi", "tools": tools, "tool_choice": "required", "max_output_tokens": len(text.encode())}
        r = (await c.post("/v1/responses", json=body)).json()
        assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}
        items = [(i["type"], i["name"], i["arguments"], i["status"]) for i in r["output"]]
        assert items == [("function_call", "noop", "{}", "completed"),
                         ("function_call", "weather", '{"ci', "incomplete")]  # fmt: skip
        events = sse_events((await c.post("/v1/responses", json={**body, "stream": True})).text)
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert [(i["type"], i["name"], i["arguments"], i["status"]) for i in done] == items
        assert "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta") \
            == "{}" + '{"ci'  # fmt: skip
        assert events[-1]["type"] == "response.incomplete"
        assert [i["status"] for i in events[-1]["response"]["output"]] == ["completed", "incomplete"]
        stored = (await c.get(f"/v1/responses/{r['id']}")).json()
        assert [i["status"] for i in stored["output"]] == ["completed", "incomplete"]

    serve(long_args, backend, tok, check)
