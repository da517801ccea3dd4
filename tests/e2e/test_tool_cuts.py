"""A tool call cut by the token limit, through a real launch.py with the openai SDK: the built-in model
under tool_choice "required" writes calls `f(a)` until max_tokens, so the output is cut inside a call.
Chat completions answer finish_reason "length" (never "tool_calls"), the complete calls first and the
cut call last with its arguments so far (not JSON), streamed the same; the Responses API answers an
"incomplete" response whose cut call is a function_call item with status "incomplete", streamed too, and
which a follow-up response continues."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.e2e.server import Server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

MODEL = "hyssm-tiny"
PARAMS = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}
F = {"type": "function", "function": {"name": "f", "parameters": PARAMS}}
MSGS = [{"role": "user", "content": "Call f."}]
CUTS = [(30, 1), (70, 2)]  # (max_tokens, calls): cut inside the first call's arguments, inside the second's


@pytest.fixture(scope="module")
def client(api_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=api_server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _check_cut(calls: list[tuple[str, str]], n: int) -> None:
    """`n` calls of f: the complete ones valid, the last one cut (its arguments do not parse)."""
    assert len(calls) == n and all(name == "f" for name, _ in calls), calls
    for _, args in calls[:-1]:
        jsonschema.validate(json.loads(args), PARAMS)
    with pytest.raises(json.JSONDecodeError):
        json.loads(calls[-1][1])


@pytest.mark.parametrize(("max_tokens", "n"), CUTS)
def test_chat_a_call_cut_by_max_tokens_finishes_with_length(client: openai.OpenAI, max_tokens: int, n: int) -> None:
    kw = {"model": MODEL, "messages": MSGS, "tools": [F], "tool_choice": "required", "max_tokens": max_tokens,
          "temperature": 0}
    whole = client.chat.completions.create(**kw)
    (choice,) = whole.choices
    assert choice.finish_reason == "length" and whole.usage.completion_tokens == max_tokens
    calls = [(t.function.name, t.function.arguments) for t in choice.message.tool_calls]
    _check_cut(calls, n)
    assert len({t.id for t in choice.message.tool_calls}) == n
    streamed: list[list[str]] = []
    reasons = []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for part in chunk.choices[0].delta.tool_calls or []:
            if part.index == len(streamed):
                assert part.id and part.function.name
                streamed.append([part.function.name, part.function.arguments or ""])
            else:
                streamed[part.index][1] += part.function.arguments or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert [r for r in reasons if r] == ["length"]
    assert [tuple(c) for c in streamed] == calls


def test_chat_named_call_cut_by_max_tokens(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MSGS, tools=[F], max_tokens=3, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "f"}})
    assert r.choices[0].finish_reason == "length"
    _check_cut([(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls], 1)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "f"}])
def test_responses_a_call_cut_by_max_output_tokens_is_incomplete(client: openai.OpenAI, choice) -> None:  # noqa: ANN001
    max_tokens, n = CUTS[1] if choice == "required" else (3, 1)
    kw = {"model": MODEL, "input": "Call f.", "tools": [{"type": "function", "name": "f", "parameters": PARAMS}],
          "tool_choice": choice, "max_output_tokens": max_tokens, "temperature": 0}
    r = client.responses.create(**kw)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [i.type for i in r.output] == ["function_call"] * n
    assert [i.status for i in r.output] == ["completed"] * (n - 1) + ["incomplete"]
    _check_cut([(i.name, i.arguments) for i in r.output], n)
    events = list(client.responses.create(**kw, stream=True))
    assert events[-1].type == "response.incomplete"
    final = events[-1].response
    assert [(i.type, i.name, i.arguments, i.status) for i in final.output] == \
        [(i.type, i.name, i.arguments, i.status) for i in r.output]  # fmt: skip
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.status for i in done] == [i.status for i in r.output]
    assert client.responses.retrieve(r.id).output[-1].status == "incomplete"
    follow = client.responses.create(model=MODEL, input="Go on.", previous_response_id=r.id, tools=kw["tools"],
                                     max_output_tokens=2)  # fmt: skip
    assert follow.usage.input_tokens > r.usage.input_tokens  # the cut call is part of the conversation
