"""The OpenAI Responses API (POST /v1/responses) through a real launch.py with the openai SDK's
`client.responses`: text equal to the chat completion of the same conversation, the streamed events
in OpenAI's order adding up to the final response, `previous_response_id` continuing a conversation
(instructions not carried over), function tools and their outputs, `text.format` structured output,
`store` honoured (retrieve, delete), and what is out of scope refused with a 400 naming it; /version."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.e2e.server import Server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

MODEL = "hyssm-tiny"
WEATHER = {"type": "function", "name": "weather", "description": "The weather of a city.",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                          "required": ["city"]}}  # fmt: skip


@pytest.fixture(scope="module")
def client(api_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=api_server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _chat(client: openai.OpenAI, messages: list[dict], n: int) -> str:
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=n, temperature=0)
    return reply.choices[0].message.content or ""


def test_text_equals_the_chat_completion_and_conversations_continue(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="Tell me a story.", instructions="Be brief.",
                                    max_output_tokens=8, temperature=0)  # fmt: skip
    assert first.object == "response" and first.id.startswith("resp_")
    assert first.output_text == _chat(client, [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "Tell me a story."}], 8)  # fmt: skip
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    assert first.usage.output_tokens == 8 and first.usage.input_tokens > 0
    second = client.responses.create(model=MODEL, input="And then?", previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0)  # fmt: skip
    history = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "And then?"}]  # the first instructions are not carried over
    assert second.output_text == _chat(client, history, 6)
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text


def test_streamed_events_come_in_order_and_add_up(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model=MODEL, input=[{"role": "user", "content": "Hello"}],
                                          max_output_tokens=10, temperature=0, stream=True))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == events[-4].text
    whole = client.responses.create(model=MODEL, input="Hello", max_output_tokens=10, temperature=0)
    assert whole.output_text == text
    assert client.responses.retrieve(final.id).id == final.id


def test_function_tools_and_their_outputs(client: openai.OpenAI) -> None:
    called = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER], temperature=0,
                                     tool_choice={"type": "function", "name": "weather"}, max_output_tokens=40)
    (call,) = [item for item in called.output if item.type == "function_call"]
    assert call.name == "weather" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
    follow = client.responses.create(model=MODEL, previous_response_id=called.id, tools=[WEATHER],
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "sunny"}], max_output_tokens=5)  # fmt: skip
    assert follow.usage.input_tokens > called.usage.input_tokens
    streamed = list(client.responses.create(model=MODEL, input="Weather in Rome?", tools=[WEATHER], stream=True,
                                            tool_choice={"type": "function", "name": "weather"},
                                            max_output_tokens=40, temperature=0))  # fmt: skip
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].name == "weather" and json.loads(done[0].arguments)
    assert streamed[-1].type == "response.completed"
    assert [i.type for i in streamed[-1].response.output] == ["function_call"]


def test_text_format_json_schema(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"size": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["size"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="A size, as JSON.", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "size", "schema": schema,
                                                 "strict": True}})  # fmt: skip
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_store_false_is_not_kept_and_delete_removes(client: openai.OpenAI, api_server: Server) -> None:
    kept = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    loose = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with httpx.Client(base_url=api_server.url, timeout=30) as http:
        assert http.get(f"/v1/responses/{loose.id}").status_code == 404
        assert http.delete(f"/v1/responses/{kept.id}").json()["deleted"] is True
        gone = http.get(f"/v1/responses/{kept.id}")
        assert gone.status_code == 404 and gone.json()["error"]["param"] == "response_id"
        assert http.get("/version").json()["version"]


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"input": "hi", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({}, "input"),
])  # fmt: skip
def test_out_of_scope_fields_are_400s_naming_them(api_server: Server, body: dict, param: str) -> None:
    with httpx.Client(base_url=api_server.url, timeout=30) as http:
        r = http.post("/v1/responses", json={"model": MODEL, **body})
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text
        assert http.get("/health").status_code == 200
