"""Tool-call formats (--tool-call-parser): each family's format read whole and streamed in pieces of any
size to the same calls (the streamed argument fragments adding up to the whole answer's arguments),
qwen3_coder values typed by their schema, a parser reading only its own format, the calls of a
`required` array cut short kept, and an output cut by the token limit (`cut`): its complete calls kept,
the call it was cut in read with the arguments written so far, whole and streamed alike."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tokenizer_proc.requests.tool_parsers import CallStream, param_types, parse_calls, read_calls

TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "units": {"type": "object"}}}}},
    {"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {}}}}]
TYPES = param_types(TOOLS)
HERMES = ('Let me look. <tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "units": {"t": ["C"]}}}'
          '\n</tool_call>\n<tool_call>\n{"name": "clock", "arguments": {}}\n</tool_call>')
CODER = ("<tool_call>\n<function=weather>\n<parameter=city>\n2049\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
         "</function>\n</tool_call>")
CALLS = {
    "hermes": (HERMES, "Let me look.", [("weather", {"city": "Paris", "units": {"t": ["C"]}}), ("clock", {})]),
    "qwen3_coder": (CODER, None, [("weather", {"city": "2049", "days": 3})]),
    "granite": ('<|tool_call|>[{"name": "clock", "arguments": {}}, {"name": "weather", "arguments": {"days": 2}}]',
                None, [("clock", {}), ("weather", {"days": 2})]),
    "nemotron": ('<TOOLCALL>[{"name": "weather", "arguments": {"city": "Rome"}}]</TOOLCALL>', None,
                 [("weather", {"city": "Rome"})]),
}  # fmt: skip


def _stream(stream: CallStream, text: str, step: int, cut: bool = False) -> tuple[str, list[dict[str, Any]]]:
    content, calls = "", []
    deltas: list[dict[str, Any]] = []
    for i in range(0, len(text), step):
        c, d = stream.feed(text[i : i + step])
        content, deltas = content + c, deltas + d
    c, d = stream.finish(cut)
    content, deltas = content + c, deltas + d
    for d in deltas:
        if "id" in d:
            assert d["index"] == len(calls)
            calls.append({"name": d["function"]["name"], "arguments": d["function"]["arguments"]})
        else:
            calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return content, calls


@pytest.mark.parametrize("parser", list(CALLS))
@pytest.mark.parametrize("driver", ["own", "auto"])
def test_each_format_whole_and_streamed(parser: str, driver: str) -> None:
    text, content, want = CALLS[parser]
    name = parser if driver == "own" else "auto"
    got_content, got = parse_calls(name, text, TYPES)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == want
    for step in (1, 3, 7, len(text)):
        s_content, s_calls = _stream(CallStream(name, "auto", TYPES), text, step)
        assert [(c["name"], c["arguments"]) for c in s_calls] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in got], step
        assert s_content.split() == (content or "").split()


def test_a_parser_reads_its_own_format_only() -> None:
    nemotron = CALLS["nemotron"][0]
    assert parse_calls("hermes", nemotron, TYPES) == (nemotron, [])
    assert parse_calls("nemotron", HERMES, TYPES) == (HERMES, [])


def test_arguments_stream_as_fragments() -> None:
    text = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "days": 12}}\n</tool_call>'
    stream = CallStream("hermes", "auto", TYPES)
    sent = [d for i in range(len(text)) for d in stream.feed(text[i])[1]]
    assert sent[0]["function"]["name"] == "weather"
    fragments = [d["function"]["arguments"] for d in sent]
    assert len(fragments) > 5 and "".join(fragments) == '{"city": "Paris", "days": 12}'


def test_an_xml_call_cut_short_is_no_call() -> None:
    cut = CODER[: CODER.index("</parameter>")]
    assert parse_calls("qwen3_coder", cut, TYPES) == (cut, [])


def test_required_array_cut_short_keeps_its_complete_calls() -> None:
    stream = CallStream("auto", "required", TYPES)
    text = '[{"name": "clock", "arguments": {}}, {"name": "weather", "arguments": {"city": "Ro'
    stream.feed(text)
    stream.finish()
    assert [c["function"]["name"] for c in stream.calls()] == ["clock"]


CUT = {  # (parser, mode, output cut by the token limit, content, complete calls, the cut call)
    "required, in the second call": ("auto", "required", '[{"name": "clock", "arguments": {}}, {"name": "weather",'
                                     ' "arguments": {"city": "Par', None, [("clock", "{}")],
                                     ("weather", '{"city": "Par')),
    "required, before the arguments": ("auto", "required", '[{"name": "weather", "arguments": {"days": 3}}, '
                                       '{"name": "clock",', None, [("weather", '{"days": 3}')], ("clock", "")),
    "required, in the first name": ("auto", "required", '[{"name": "wea', '[{"name": "wea', [], None),
    "hermes, in the second call": ("hermes", "auto", HERMES[: HERMES.index("{}")], "Let me look.",
                                   [("weather", '{"city": "Paris", "units": {"t": ["C"]}}')], ("clock", "")),
    "hermes, in a nested value": ("hermes", "auto", HERMES[: HERMES.index('"C"')], "Let me look.", [],
                                  ("weather", '{"city": "Paris", "units": {"t": [')),
    "granite, in the list": ("granite", "auto", CALLS["granite"][0][:-4], None, [("clock", "{}")],
                             ("weather", '{"days":')),
    "qwen3_coder, in a parameter": ("qwen3_coder", "auto", CODER[: CODER.index("3\n</parameter>")], None, [],
                                    ("weather", '{"city": "2049"')),
    "named": ("auto", "named", '{"city": "Rome", "days": 1', None, [], ("weather", '{"city": "Rome", "days": 1')),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CUT))
def test_an_output_cut_by_the_token_limit_reports_the_call_it_was_cut_in(case: str) -> None:
    parser, mode, text, content, complete, last = CUT[case]
    want = [*complete, *([last] if last else [])]
    if mode == "auto":
        got_content, calls, cut_call = read_calls(parser, text, TYPES, cut=True)
        assert got_content == content
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == complete
        got_last = (cut_call["function"]["name"], cut_call["function"]["arguments"]) if cut_call else None
        assert got_last == last and (cut_call is None or cut_call["id"].startswith("call_"))
        assert read_calls(parser, text, TYPES)[2] is None  # an output that ended by itself: no cut call
    for step in (1, 4, len(text)):
        stream = CallStream(parser, mode, TYPES, name="weather")
        s_content, s_calls = _stream(stream, text, step, cut=True)
        assert [(c["name"], c["arguments"]) for c in s_calls] == want, step
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in stream.calls()] == complete
        cut_call = stream.cut_call()
        assert (cut_call["function"]["name"], cut_call["function"]["arguments"]) == last if last else cut_call is None
        if mode == "auto" or not want:
            assert (s_content.strip() or None) == content
