"""Reasoning output (--reasoning-parser) and --chat-template: where reasoning starts for each parser
and template (a Qwen3-style template with enable_thinking, a DeepSeek-R1-style one that opens it), the
split of whole outputs and of streams cut anywhere, separate_reasoning / stream_reasoning, tool calls
read after the reasoning, and a grammar that waits for `</think>`; over HTTP with a fake backend."""

from __future__ import annotations

import json
import os
from typing import Any

import httpx
import pytest

from shared.config import ServerArgs
from shared.messages import ThinkingBudget
from tests.tokenizer.conftest import FakeBackend, text_plan, write_model_dir
from tests.tokenizer.test_app import serve, sse_events
from tokenizer_proc.requests.chat_template import ChatTemplateError
from tokenizer_proc.requests.reasoning import ReasoningStream, plan_reasoning, split_reasoning
from tokenizer_proc.requests.tokenizer import ChatConventions, TextTokenizer

TEMPLATES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "chat_templates")
CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "What is 2 + 2?"}]
THOUGHT = "<think>\nTwo and two.\n\nFour.\n</think>\n\nIt is 4."


def _streamed(plan: Any, text: str, step: int) -> tuple[str, str]:
    rs, thought, content = ReasoningStream(plan), "", ""
    for i in range(0, len(text), step):
        t, c = rs.feed(text[i : i + step])
        thought, content = thought + t, content + c
    t, c = rs.finish()
    return thought + t, content + c


@pytest.mark.parametrize(("parser", "prompt", "text", "want"), [
    ("qwen3", "<|im_start|>assistant\n", THOUGHT, ("Two and two.\n\nFour.", "It is 4.")),
    ("qwen3", "<|im_start|>assistant\n", "It is 4.", (None, "It is 4.")),  # no thinking at all
    ("qwen3", "<|im_start|>assistant\n<think>\n", "Hmm.\n</think>\n\n4", ("Hmm.", "4")),  # the prompt opened it
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "<think>x</think>4", (None, "<think>x</think>4")),
    ("deepseek-r1", "<｜Assistant｜><think>\n", "Still thinking", ("Still thinking", "")),  # cut before it ended
    ("nemotron", "Assistant\n", THOUGHT, ("Two and two.\n\nFour.", "It is 4.")),
])  # fmt: skip
def test_where_reasoning_starts_and_ends(parser: str, prompt: str, text: str, want: tuple) -> None:
    plan = plan_reasoning(parser, prompt)
    thought, content = split_reasoning(plan, text)
    assert (thought, content) == want
    for step in (1, 2, 5, len(text)):
        assert _streamed(plan, text, step) == (want[0] or "", want[1])


def test_separate_and_stream_reasoning_flags() -> None:
    kept = plan_reasoning("qwen3", "", separate=False)
    assert split_reasoning(kept, THOUGHT) == (None, THOUGHT) and _streamed(kept, THOUGHT, 3) == ("", THOUGHT)
    held = plan_reasoning("qwen3", "", stream=False)
    rs = ReasoningStream(held)
    pieces = [rs.feed(THOUGHT[i : i + 4]) for i in range(0, len(THOUGHT), 4)]
    thoughts = [t for t, _ in pieces if t]
    assert thoughts == ["Two and two.\n\nFour."]  # one delta, when the reasoning ends


def _tok(model_dir: str, template: str, parser: str) -> TextTokenizer:
    return TextTokenizer.from_dir(model_dir, chat=ChatConventions(os.path.join(TEMPLATES, template), "auto", parser))


def test_chat_template_flag_files_names_and_errors(model_dir: str, tmp_path) -> None:
    tok = _tok(model_dir, "qwen3.jinja", "qwen3")
    on = tok.render_chat(MSGS)
    off = tok.render_chat(MSGS, extra={"enable_thinking": False})
    assert on.endswith("<|im_start|>assistant\n") and off.endswith("<think>\n\n</think>\n\n")
    assert plan_reasoning("qwen3", on).may_reason and not plan_reasoning("qwen3", off).may_reason
    named = tmp_path / "named"
    named.mkdir()
    for f in ("tokenizer.json", "config.json"):
        os.link(os.path.join(model_dir, f), named / f)
    with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    cfg["chat_template"] = [{"name": "default", "template": "{{ messages[0].content }}"},
                            {"name": "tool_use", "template": "TOOLS {{ messages[0].content }}"}]  # fmt: skip
    (named / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert TextTokenizer.from_dir(str(named)).render_chat(MSGS) == MSGS[0]["content"]
    picked = TextTokenizer.from_dir(str(named), chat=ChatConventions("tool_use"))
    assert picked.render_chat(MSGS) == "TOOLS " + MSGS[0]["content"]
    with pytest.raises(ChatTemplateError, match="default, tool_use"):
        TextTokenizer.from_dir(str(named), chat=ChatConventions("nope"))


def test_http_reasoning_content_whole_and_streamed(model_dir: str) -> None:
    tok = _tok(model_dir, "qwen3.jinja", "qwen3")
    args = ServerArgs(model_path=model_dir, max_new_tokens_limit=64, reasoning_parser="qwen3")
    backend = FakeBackend(plan=text_plan(THOUGHT, per_out=3))
    n = len(THOUGHT.encode())

    async def check(c: httpx.AsyncClient) -> None:
        body = {"messages": MSGS, "max_tokens": n}
        msg = (await c.post(CHAT, json=body)).json()["choices"][0]["message"]
        assert msg["reasoning_content"] == "Two and two.\n\nFour." and msg["content"] == "It is 4."
        events = sse_events((await c.post(CHAT, json={**body, "stream": True})).text)
        deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == msg["reasoning_content"]
        assert "".join(d.get("content", "") for d in deltas) == "It is 4."
        assert sum("reasoning_content" in d for d in deltas) > 1  # streamed as it came
        plain = (await c.post(CHAT, json={**body, "separate_reasoning": False})).json()["choices"][0]["message"]
        assert plain["content"] == THOUGHT and plain.get("reasoning_content") is None

    serve(args, backend, tok, check)


def test_http_tool_calls_and_grammar_come_after_the_reasoning(tmp_path) -> None:
    model_dir = write_model_dir(str(tmp_path / "long"), context=2048)  # the template's tools block is long
    tok = _tok(model_dir, "qwen3.jinja", "qwen3")
    args = ServerArgs(model_path=model_dir, max_new_tokens_limit=160, reasoning_parser="qwen3")
    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    text = "<think>\nA city: <tool_call> is how I call.\n</think>\n\n" + call
    backend = FakeBackend(plan=text_plan(text, per_out=5, stop=True))
    weather = {"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip

    async def check(c: httpx.AsyncClient) -> None:
        body = {"messages": MSGS, "tools": [weather], "max_tokens": len(text.encode()) + 1}
        r = (await c.post(CHAT, json=body)).json()
        assert "choices" in r, r
        ch = r["choices"][0]
        assert ch["message"]["reasoning_content"] == "A city: <tool_call> is how I call."
        assert ch["finish_reason"] == "tool_calls" and ch["message"]["content"] is None
        assert [json.loads(t["function"]["arguments"]) for t in ch["message"]["tool_calls"]] == [{"city": "Rome"}]
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
        await c.post(CHAT, json={"messages": MSGS, "max_tokens": 4, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})  # fmt: skip

    serve(args, backend, tok, check)
    assert backend.submitted[-1].sampling.grammar.after == tuple(tok.encode("</think>", add_special_tokens=False))
    assert backend.submitted[0].sampling.grammar is None


def test_include_reasoning_and_thinking_token_budget(model_dir: str) -> None:
    tok = _tok(model_dir, "qwen3.jinja", "qwen3")
    args = ServerArgs(model_path=model_dir, max_new_tokens_limit=64, reasoning_parser="qwen3")
    backend = FakeBackend(plan=text_plan(THOUGHT, per_out=3))
    n = len(THOUGHT.encode())

    async def check(c: httpx.AsyncClient) -> None:
        body = {"messages": MSGS, "max_tokens": n, "include_reasoning": False}
        msg = (await c.post(CHAT, json=body)).json()["choices"][0]["message"]
        assert msg["content"] == "It is 4." and msg["reasoning_content"] is None
        events = sse_events((await c.post(CHAT, json={**body, "stream": True})).text)
        deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
        assert not any("reasoning_content" in d for d in deltas)
        assert "".join(d.get("content", "") for d in deltas) == "It is 4."
        r = await c.post(CHAT, json={"messages": MSGS, "max_tokens": 8, "thinking_token_budget": 5})
        assert r.status_code == 200, r.text
        r = await c.post(CHAT, json={"messages": MSGS, "max_tokens": 8, "thinking_token_budget": -1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget"

    serve(args, backend, tok, check)
    enc = lambda text: tuple(tok.encode(text, add_special_tokens=False))  # noqa: E731
    assert backend.submitted[-1].sampling.thinking_budget == ThinkingBudget(
        tokens=5, start=enc("<think>"), end=enc("</think>"), inside=False)  # fmt: skip
    assert backend.submitted[0].sampling.thinking_budget is None


def test_a_thinking_budget_needs_a_reasoning_parser(model_dir: str) -> None:
    tok = TextTokenizer.from_dir(model_dir)

    async def check(c: httpx.AsyncClient) -> None:
        r = await c.post(CHAT, json={"messages": MSGS, "max_tokens": 4, "thinking_token_budget": 5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget"
        assert "--reasoning-parser" in r.json()["error"]["message"]

    serve(ServerArgs(model_path=model_dir), FakeBackend(), tok, check)


def test_a_request_brings_its_own_template_only_when_trusted(model_dir: str) -> None:
    own = "{% for m in messages %}[{{ m.role }}: {{ m.content }}]{% endfor %}"
    for trusted in (False, True):
        tok = TextTokenizer.from_dir(model_dir, chat=ChatConventions(trust_request_template=trusted))
        args = ServerArgs(model_path=model_dir, trust_request_chat_template=trusted)
        backend = FakeBackend()

        async def check(c: httpx.AsyncClient, trusted: bool = trusted, tok: TextTokenizer = tok) -> None:
            body = {"messages": MSGS, "max_tokens": 2, "chat_template": own}
            r = await c.post(CHAT, json=body)
            t = await c.post("/tokenize", json={"messages": MSGS, "chat_template": own})
            if not trusted:
                for resp in (r, t):
                    assert resp.status_code == 400 and resp.json()["error"]["param"] == "chat_template"
                    assert "--trust-request-chat-template" in resp.json()["error"]["message"]
                return
            assert r.status_code == 200 and t.status_code == 200
            assert t.json()["tokens"] == tok.encode("[user: What is 2 + 2?]", add_special_tokens=False)
            bad = await c.post(CHAT, json={**body, "chat_template": "{% for %}"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template"
            plain = await c.post(CHAT, json={"messages": MSGS, "max_tokens": 2})  # the server's own still serves
            assert plain.status_code == 200

        serve(args, backend, tok, check)
        if trusted:
            assert backend.submitted[0].input_ids == tok.encode("[user: What is 2 + 2?]", add_special_tokens=False)
            assert backend.submitted[-1].input_ids == tok.encode(tok.render_chat(MSGS), add_special_tokens=False)
