"""Chat templates, reasoning and tool-call parsers through a real launch.py with the real clients:
`--chat-template` with a DeepSeek-R1-style template and `--reasoning-parser deepseek-r1` (the output
comes back as `reasoning_content`, whole and streamed, and as content with separate_reasoning false;
thinking_token_budget ends it by forcing `</think>`, include_reasoning false drops it; the Responses API
returns it as a reasoning item),
and `--tool-call-parser qwen3_coder` reading calls in the Qwen3-Coder XML format (the built-in model
is made to write one by a regex constraint) with the openai SDK and langchain-openai."""

from __future__ import annotations

import os

import openai
import pytest

from tests.e2e.server import ROOT, running_server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

MODEL = "hyssm-tiny"
TEMPLATES = os.path.join(ROOT, "tests", "fixtures", "chat_templates")
MSGS = [{"role": "user", "content": "Think first."}]
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}  # fmt: skip
XML_CALL = ("<tool_call>\n<function=weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n</function>\n</tool_call>")


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_reasoning_content_with_a_template_that_opens_it() -> None:
    args = ["--chat-template", os.path.join(TEMPLATES, "deepseek_r1.jinja"), "--reasoning-parser", "deepseek-r1",
            "--random-seed", "0"]  # fmt: skip
    with running_server(args) as server:
        client = _client(server.url)
        kept = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=12, temperature=0,
                                              extra_body={"separate_reasoning": False})  # fmt: skip
        whole = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=12, temperature=0)
        msg = whole.choices[0].message
        text = kept.choices[0].message.content
        assert "</think>" not in text  # never closed: all of it is reasoning
        assert msg.model_extra["reasoning_content"] == text.strip("\n") and msg.content is None
        stream = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=12, temperature=0,
                                                stream=True)  # fmt: skip
        deltas = [c.choices[0].delta for c in stream if c.choices]
        assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == text.strip("\n")
        assert not "".join(d.content or "" for d in deltas)
        capped = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=20, temperature=0,
                                                extra_body={"thinking_token_budget": 4, "return_token_ids": True})
        ids = capped.choices[0].model_extra["token_ids"]
        assert ids[:4] == list(text.encode())[:4] and ids[4:12] == list(b"</think>")  # forced after 4 tokens
        assert capped.choices[0].message.model_extra["reasoning_content"] == text.encode()[:4].decode().strip("\n")
        resp = client.responses.create(model=MODEL, input=MSGS[0]["content"], max_output_tokens=12, temperature=0)
        (item,) = resp.output  # cut while reasoning: the reasoning item alone
        assert item.type == "reasoning" and item.content[0].text == text.strip("\n")
        events = list(client.responses.create(model=MODEL, input=MSGS[0]["content"], max_output_tokens=12,
                                              temperature=0, stream=True))  # fmt: skip
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == text.strip("\n")
        dropped = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=20, temperature=0,
                                                 extra_body={"thinking_token_budget": 4, "include_reasoning": False})
        assert dropped.choices[0].message.model_extra["reasoning_content"] is None
        assert dropped.choices[0].message.content == capped.choices[0].message.content


def test_qwen3_coder_tool_calls_with_the_openai_sdk_and_langchain() -> None:
    from langchain_openai import ChatOpenAI

    args = ["--chat-template", os.path.join(TEMPLATES, "qwen3_coder.jinja"), "--tool-call-parser", "qwen3_coder",
            "--enable-auto-tool-choice", "--random-seed", "0"]  # fmt: skip
    forced = {"guided_regex": XML_CALL.replace("\n", "\\n")}
    with running_server(args) as server:
        client = _client(server.url)
        r = client.chat.completions.create(model=MODEL, messages=MSGS, tools=[WEATHER], max_tokens=200,
                                           temperature=0, extra_body=forced)  # fmt: skip
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "weather"
        assert call.function.arguments == '{"city": "Paris", "days": 3}'  # days typed by its schema
        chunks = list(client.chat.completions.create(model=MODEL, messages=MSGS, tools=[WEATHER], max_tokens=200,
                                                     temperature=0, stream=True, extra_body=forced))  # fmt: skip
        parts = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
        assert parts[0].function.name == "weather" and "".join(p.function.arguments or "" for p in parts) == \
            call.function.arguments
        llm = ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="none", temperature=0, max_tokens=200,
                         extra_body=forced).bind_tools([WEATHER])  # fmt: skip
        reply = llm.invoke("weather?")
        assert reply.tool_calls[0]["name"] == "weather" and reply.tool_calls[0]["args"] == {"city": "Paris", "days": 3}
