"""The tool-call and reasoning parsers on each family's chat template (fixtures written in the published
text layouts of the released checkpoints: Granite 4.0-H, Granite 3 / Bamba, Nemotron-H (Nano 2), Falcon-H1,
Qwen3-Next (Qwen3), Qwen3.5 (Qwen3-Coder XML calls)): the tools block reaches the prompt, a call the
template writes for an earlier assistant turn is the call the server's parser reads back (so a model
trained on the template is understood), and the reasoning starts where the template leaves it; over HTTP,
a reply written in the template's own call format comes back as `tool_calls`."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from shared.config import ServerArgs
from tests.tokenizer.conftest import FakeBackend, text_plan, write_model_dir
from tests.tokenizer.test_app import serve
from tokenizer_proc.requests.reasoning import plan_reasoning
from tokenizer_proc.requests.tokenizer import ChatConventions, TextTokenizer
from tokenizer_proc.requests.tool_parsers import param_types, parse_calls
from tokenizer_proc.requests.tools import template_message_calls

TEMPLATES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "chat_templates")
WEATHER = {"type": "function", "function": {"name": "weather", "description": "Weather of a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}  # fmt: skip
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, CLOCK]
ARGS = {"city": "Paris", "days": 3}

# template -> (tool-call parser, reasoning parser or "", the generation prompt's end)
FAMILIES = {
    "granite4.jinja": ("hermes", "", "<|start_of_role|>assistant<|end_of_role|>"),
    "granite3.jinja": ("granite", "", "<|start_of_role|>assistant<|end_of_role|>"),
    "nemotron_nano_v2.jinja": ("nemotron", "nemotron", "<SPECIAL_11>Assistant\n<think>\n"),
    "falcon_h1.jinja": ("hermes", "", "<|im_start|>assistant\n"),
    "qwen3.jinja": ("hermes", "qwen3", "<|im_start|>assistant\n"),
    "qwen3_coder.jinja": ("qwen3_coder", "qwen3", "<|im_start|>assistant\n"),
}


def _tok(model_dir: str, template: str, reasoning: str = "") -> TextTokenizer:
    parser = FAMILIES[template][0]
    return TextTokenizer.from_dir(model_dir, chat=ChatConventions(os.path.join(TEMPLATES, template), parser,
                                                                  reasoning))  # fmt: skip


def _conversation(calls: list[tuple[str, dict]]) -> list[dict]:
    """A system and a user turn, then an assistant turn making `calls` (as the chat endpoint hands
    messages to templates)."""
    made = [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for i, (n, a) in enumerate(calls)]  # fmt: skip
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": template_message_calls(made)}]  # fmt: skip


@pytest.mark.parametrize("template", list(FAMILIES))
def test_the_parser_reads_the_calls_its_template_writes(model_dir: str, template: str) -> None:
    parser, _, _ = FAMILIES[template]
    tok = _tok(model_dir, template)
    calls = [("weather", ARGS), ("clock", {})]
    head = tok.render_chat(_conversation(calls)[:2], add_generation_prompt=False, tools=TOOLS)
    whole = tok.render_chat(_conversation(calls), add_generation_prompt=False, tools=TOOLS)
    assert whole.startswith(head)
    for tool in TOOLS:  # the tools block: every definition reaches the prompt
        assert tool["function"]["name"] in head
    assert "Weather of a city." in head
    turn = whole[len(head):]  # the earlier assistant turn, as the model was trained to write calls
    _, got = parse_calls(parser, turn, param_types(TOOLS))
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    _, also = parse_calls("auto", turn, param_types(TOOLS))  # the default parser reads every family
    assert [c["function"]["name"] for c in also] == ["weather", "clock"]


@pytest.mark.parametrize("template", list(FAMILIES))
def test_the_generation_prompt_and_where_reasoning_starts(model_dir: str, template: str) -> None:
    _, reasoning, tail = FAMILIES[template]
    tok = _tok(model_dir, template)
    prompt = tok.render_chat(_conversation([])[:2], tools=TOOLS)
    assert prompt.endswith(tail)
    if not reasoning:
        return
    plan = plan_reasoning(reasoning, prompt)
    assert plan is not None and plan.may_reason and plan.inside == prompt.endswith("<think>\n")


def test_nemotron_no_think_closes_the_reasoning(model_dir: str) -> None:
    tok = _tok(model_dir, "nemotron_nano_v2.jinja")
    msgs = [{"role": "system", "content": "/no_think"}, {"role": "user", "content": "Hi"}]
    prompt = tok.render_chat(msgs)
    assert prompt.endswith("<think></think>") and "/no_think" not in prompt
    plan = plan_reasoning("nemotron", prompt)
    assert plan is not None and not plan.may_reason
    kept = tok.render_chat([*msgs, {"role": "assistant", "content": "<think>hmm</think>Hello"}],
                           add_generation_prompt=False)  # fmt: skip
    assert "hmm" not in kept and "Hello" in kept  # earlier turns are kept without their reasoning


FORMATS = {  # a reply in each template's own call format
    "granite4.jinja": '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
    "granite3.jinja": '<|tool_call|>[{"name": "weather", "arguments": {"city": "Paris", "days": 3}}]',
    "nemotron_nano_v2.jinja": ('Let me see.\n</think>\n<TOOLCALL>[{"name": "weather", "arguments": {"city": '
                               '"Paris", "days": 3}}]</TOOLCALL>'),
    "falcon_h1.jinja": '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
}


@pytest.mark.parametrize("template", list(FORMATS))
def test_http_a_reply_in_the_template_format_is_a_tool_call(tmp_path, template: str) -> None:
    model_dir = write_model_dir(str(tmp_path / "m"), context=2048)
    parser, reasoning, _ = FAMILIES[template]
    tok = _tok(model_dir, template, reasoning)
    args = ServerArgs(model_path=model_dir, max_new_tokens_limit=256, tool_call_parser=parser,
                      reasoning_parser=reasoning)  # fmt: skip
    text = FORMATS[template]
    backend = FakeBackend(plan=text_plan(text, per_out=4, stop=True))

    async def check(c: httpx.AsyncClient) -> None:
        body = {"messages": _conversation([])[:2], "tools": TOOLS, "max_tokens": len(text.encode()) + 1}
        r = (await c.post("/v1/chat/completions", json=body)).json()
        choice = r["choices"][0]
        assert choice["finish_reason"] == "tool_calls", r
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "weather" and json.loads(call["function"]["arguments"]) == ARGS
        if reasoning:
            assert choice["message"]["reasoning_content"] == "Let me see."

    serve(args, backend, tok, check)
