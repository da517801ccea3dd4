"""Structured output and tools through a real launch.py with the real clients: openai
(`response_format` json_schema checked with jsonschema, `beta.chat.completions.parse` with a pydantic
model, regex / choice / EBNF constraints, every tool_choice, streamed tool calls) and langchain-openai
(`with_structured_output` with each method, `bind_tools`, the completions LLM's `batch`). The built-in
model writes poor text, so the assertions are on protocol shapes, grammar validity and determinism."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.e2e.server import Server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

MODEL = "hyssm-tiny"
MSGS = [{"role": "user", "content": "Answer in JSON."}]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["ok", "color", "size"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "weather", "description": "The weather of a city.",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"enum": ["Paris", "Rome"]}},
                                                           "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {}}}}


class Answer(BaseModel):
    """An answer."""

    ok: bool
    color: Literal["red", "green"]


@pytest.fixture(scope="module")
def server(api_server: Server) -> Server:
    return api_server



def test_json_schema_output_validates_and_is_deterministic(openai_client: openai.OpenAI) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    texts = []
    for seed in (1, 1, 2):
        r = openai_client.chat.completions.create(model=MODEL, messages=MSGS, response_format=rf, max_tokens=60,
                                           temperature=1.0, seed=seed)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
        texts.append(r.choices[0].message.content)
    assert texts[0] == texts[1]
    parsed = openai_client.beta.chat.completions.parse(model=MODEL, messages=MSGS, response_format=Answer,
                                                       max_tokens=60)
    assert isinstance(parsed.choices[0].message.parsed, Answer)
    stream = openai_client.chat.completions.create(model=MODEL, messages=MSGS, response_format=rf, max_tokens=60,
                                            temperature=1.0, seed=1, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == texts[0]


def test_regex_choice_and_ebnf(openai_client: openai.OpenAI, server: Server) -> None:
    r = openai_client.completions.create(model=MODEL, prompt="code:", max_tokens=12, temperature=1.0, seed=3,
                                  extra_body={"guided_regex": "[0-9]{3}-[a-c]{2}"})
    assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = openai_client.completions.create(model=MODEL, prompt="yes or no?", max_tokens=5, n=3, temperature=1.0,
                                  extra_body={"guided_choice": ["yes", "no"]})
    assert {c.text for c in r.choices} <= {"yes", "no"}
    r = openai_client.completions.create(model=MODEL, prompt="g", max_tokens=12, temperature=1.0, seed=1,
                                  extra_body={"guided_grammar": 'root ::= ("ab" | "cd")+ "."'})
    full = r"(ab|cd)+\." if r.choices[0].finish_reason == "stop" else r"(ab|cd)*[ac]?"  # a prefix when cut
    assert re.fullmatch(full, r.choices[0].text)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        out = c.post("/generate", json={"text": "x", "sampling_params": {
            "max_new_tokens": 30, "temperature": 1.0, "seed": 5, "ebnf": 'root ::= "a" [b-d]* "!"'}}).json()
        assert re.fullmatch(r"a[b-d]*!", out["text"]) and out["meta_info"]["finish_reason"]["type"] == "stop"
        js = json.dumps({"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2})
        out = c.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 30, "json_schema": js}})
        assert isinstance(json.loads(out.json()["text"]), list)
        bad = c.post("/generate", json={"text": "x", "sampling_params": {"regex": "(a"}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "sampling_params.regex"


def test_tool_choices(openai_client: openai.OpenAI) -> None:
    tools = [WEATHER, CLOCK]
    named = openai_client.chat.completions.create(model=MODEL, messages=MSGS, tools=tools, max_tokens=30, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "weather"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "weather" and named.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    req = openai_client.chat.completions.create(model=MODEL, messages=MSGS, tools=tools, tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=80)
    (call,) = req.choices[0].message.tool_calls
    assert call.function.name in ("weather", "clock")
    none = openai_client.chat.completions.create(model=MODEL, messages=MSGS, tools=tools, tool_choice="none",
                                                 max_tokens=5)
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content
    auto = openai_client.chat.completions.create(model=MODEL, messages=MSGS, tools=tools, max_tokens=5)
    assert auto.choices[0].finish_reason in ("length", "stop", "tool_calls")
    history = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                             "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    follow = openai_client.chat.completions.create(model=MODEL, messages=history, tools=tools, max_tokens=4)
    assert follow.usage.prompt_tokens > auto.usage.prompt_tokens  # the call and its result were rendered
    chunks = list(openai_client.chat.completions.create(
        model=MODEL, messages=MSGS, tools=tools, max_tokens=30, stream=True, temperature=0,
        tool_choice={"type": "function", "function": {"name": "weather"}}))
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert all(len(d) == 1 and d[0].index == 0 for d in deltas) and deltas[0][0].function.name == "weather"
    assert "".join(d[0].function.arguments or "" for d in deltas) == \
        named.choices[0].message.tool_calls[0].function.arguments  # the name first, then argument fragments


def test_langchain(server: Server) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI, OpenAI

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="none", model=MODEL, temperature=0, max_tokens=80,
                     max_retries=0)
    for method in ("json_schema", "function_calling"):
        out = llm.with_structured_output(Answer, method=method).invoke("answer")
        assert isinstance(out, Answer), method
    # json_mode: any JSON object; the built-in model may not close its strings within max_tokens
    try:
        out = llm.with_structured_output(Answer, method="json_mode", include_raw=True).invoke("answer in JSON")
        raw = out["raw"].content
    except openai.LengthFinishReasonError as e:
        raw = e.completion.choices[0].message.content
    assert raw.startswith("{")

    @tool
    def weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather of a city."""
        return "sunny"

    msg = llm.bind_tools([weather], tool_choice="weather").invoke("weather in Paris?")
    assert [c["name"] for c in msg.tool_calls] == ["weather"]
    assert msg.tool_calls[0]["args"]["city"] in ("Paris", "Rome")
    msg = llm.bind_tools([weather], tool_choice="any", parallel_tool_calls=False).invoke("weather?")
    assert [c["name"] for c in msg.tool_calls] == ["weather"]
    chunks = list(llm.bind_tools([weather], tool_choice="weather").stream("weather?"))
    total = chunks[0]
    for c in chunks[1:]:
        total = total + c
    assert [c["name"] for c in total.tool_calls] == ["weather"]
    completions = OpenAI(base_url=server.url + "/v1", api_key="none", model=MODEL, temperature=0, max_tokens=4,
                         max_retries=0)
    prompts = ["one", "two", "three"]
    assert completions.batch(prompts) == [completions.invoke(p) for p in prompts]
