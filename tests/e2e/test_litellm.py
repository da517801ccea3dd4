"""litellm as its users call an OpenAI-compatible server (`openai/<model>` with `api_base`), through a
real launch.py: chat and text completions equal what the openai SDK gets for the same request,
streamed chunks add up to the whole answer, usage is reported, a forced tool call comes back parsed,
structured output through `response_format`, and a server-side 400 surfaces as litellm's
BadRequestError naming the field."""

from __future__ import annotations

import json
import os
from typing import Any

import openai
import pytest

from tests.e2e.server import Server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

MODEL = "hyssm-tiny"
MSGS = [{"role": "user", "content": "Say something."}]
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}  # fmt: skip


@pytest.fixture(scope="module")
def litellm(api_server: Server) -> Any:
    # litellm fetches its model price table from the network at import unless told to use its own copy
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm as module

    module.telemetry = False
    return module


@pytest.fixture(scope="module")
def sdk(api_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=api_server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _kw(server: Server) -> dict[str, Any]:
    return {"model": f"openai/{MODEL}", "api_base": server.url + "/v1", "api_key": "none", "timeout": 60}


def test_chat_and_text_completion_equal_the_sdk(litellm: Any, sdk: openai.OpenAI, api_server: Server) -> None:
    r = litellm.completion(**_kw(api_server), messages=MSGS, max_tokens=8, temperature=0)
    want = sdk.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == want.choices[0].message.content
    assert r.usage.completion_tokens == want.usage.completion_tokens == 8
    assert r.choices[0].finish_reason == "length"
    text = litellm.text_completion(**_kw(api_server), prompt="Once upon", max_tokens=6, temperature=0)
    plain = sdk.completions.create(model=MODEL, prompt="Once upon", max_tokens=6, temperature=0)
    assert text.choices[0].text == plain.choices[0].text


def test_streamed_chunks_add_up(litellm: Any, api_server: Server) -> None:
    whole = litellm.completion(**_kw(api_server), messages=MSGS, max_tokens=10, temperature=0)
    chunks = list(litellm.completion(**_kw(api_server), messages=MSGS, max_tokens=10, temperature=0, stream=True))
    assert len(chunks) > 2
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    rebuilt = litellm.stream_chunk_builder(chunks, messages=MSGS)
    assert rebuilt.choices[0].message.content == whole.choices[0].message.content


def test_tool_call_and_structured_output(litellm: Any, api_server: Server) -> None:
    choice = {"type": "function", "function": {"name": "weather"}}
    r = litellm.completion(**_kw(api_server), messages=MSGS, tools=[WEATHER], tool_choice=choice, max_tokens=60,
                           temperature=0)  # fmt: skip
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    number = {"type": "integer", "minimum": 0, "maximum": 99}
    schema = {"type": "object", "properties": {"n": number}, "required": ["n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "num", "schema": schema}}
    r = litellm.completion(**_kw(api_server), messages=MSGS, response_format=fmt, max_tokens=30, temperature=0)
    assert isinstance(json.loads(r.choices[0].message.content)["n"], int)


def test_a_bad_request_names_the_field(litellm: Any, api_server: Server) -> None:
    with pytest.raises(litellm.BadRequestError, match="top_logprobs"):
        litellm.completion(**_kw(api_server), messages=MSGS, max_tokens=2, logprobs=True, top_logprobs=99,
                           num_retries=0)  # fmt: skip
