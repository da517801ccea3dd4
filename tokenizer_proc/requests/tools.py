"""Tool calling on /v1/chat/completions: what the template gets, what constrains the output, and how
the output becomes OpenAI `tool_calls`.

- `tools` are passed to the chat template (OpenAI shape); assistant `tool_calls` in the history are
  given to it with `arguments` parsed to objects (templates render them as JSON), `tool` messages as
  they are.
- tool_choice `none`: no parsing, the output is content. `auto` (the default with tools): the output
  is read for calls in the format `--tool-call-parser` names (tool_parsers.py: hermes / qwen25,
  qwen3_coder, granite, nemotron; "auto" = any of them). `required`: the output is constrained by
  grammar to a JSON array of calls `{"name", "arguments"}` (one element when parallel_tool_calls is
  false), each validating against its function's parameters; a named function: constrained to its
  arguments.
- A response with calls has `message.tool_calls` (`content` holds any text outside the calls, else
  null) and finish_reason "tool_calls" when the output ended by itself. Streamed, content is sent as it
  comes until a call may start; each call's delta with its id and name comes once the name is complete,
  then its arguments as fragments (`CallStream`).
- An output cut by the token limit (max_tokens, the context) has finish_reason "length", never
  "tool_calls" (as OpenAI and vLLM report it), under every tool_choice. Its complete calls are kept, and
  the call it was cut in is reported as OpenAI reports it: last in `tool_calls`, with its id, name and
  the arguments written so far, which do not parse as JSON (`{"a": 70`; "" when cut before them;
  tool_parsers.py). A call cut before its name is complete is not a call. Streamed, the cut call's deltas
  add up to the same arguments (what was held back comes with the last chunk), so streamed and whole
  answers agree. The Responses API gives the cut call as a `function_call` item with status "incomplete".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from shared.messages import GrammarSpec
from tokenizer_proc.http.errors import bad_request
from tokenizer_proc.requests.schemas import ChatBody
from tokenizer_proc.requests.structured import json_schema_spec
from tokenizer_proc.requests.tool_parsers import CallStream, param_types, read_calls


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses tools: `mode` "" (no tools or none), "auto", "required", "named";
    `parser` the format an auto output is read in, `types` each function's parameter types."""

    mode: str = ""
    name: str | None = None
    grammar: GrammarSpec | None = None
    template_tools: list[dict[str, Any]] | None = field(default=None, compare=False)
    parser: str = "auto"
    types: dict[str, dict[str, str]] = field(default_factory=dict, compare=False)


def plan_tools(body: ChatBody, parser: str = "auto") -> ToolPlan:
    """Checks tools and tool_choice (400 naming the field) and the plan for the request; `parser`:
    --tool-call-parser."""
    plan = _plan(body)
    return replace(plan, parser=parser, types=param_types(plan.template_tools)) if plan.mode else plan


def _plan(body: ChatBody) -> ToolPlan:
    tools = body.tools or []
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools must have distinct function names", "tools")
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    template_tools = [
        {"type": "function", "function": {k: v for k, v in (("name", t.function.name),
                                                           ("description", t.function.description),
                                                           ("parameters", t.function.parameters)) if v is not None}}
        for t in tools
    ] or None
    if choice == "none":
        return ToolPlan("", template_tools=template_tools)
    if not tools:
        raise bad_request(f"tool_choice {choice if isinstance(choice, str) else 'function'} needs tools",
                          "tool_choice")
    if choice == "auto":
        return ToolPlan("auto", template_tools=template_tools)
    params = {t.function.name: t.function.parameters or {"type": "object"} for t in tools}
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"const": n}, "arguments": p},
                  "required": ["name", "arguments"], "additionalProperties": False} for n, p in params.items()]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if body.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan("required", grammar=json_schema_spec(schema, "tools"), template_tools=template_tools)
    assert not isinstance(choice, str)
    name = choice.function.name
    if name not in params:
        raise bad_request(f"tool_choice names function {name!r}, which is not among the tools", "tool_choice")
    return ToolPlan("named", name=name, grammar=json_schema_spec(params[name], f"tools[{names.index(name)}]"),
                    template_tools=template_tools)


def template_message_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant tool_calls as templates expect them: `function.arguments` an object when it is JSON."""
    out = []
    for c in calls:
        fn = dict(c["function"])
        try:
            fn["arguments"] = json.loads(fn["arguments"]) if isinstance(fn["arguments"], str) else fn["arguments"]
        except json.JSONDecodeError:
            pass
        out.append({**c, "function": fn})
    return out


class ToolOutput(NamedTuple):
    """A whole output read under a plan: `content` (text outside the calls, or None), the complete
    `calls`, and `cut_call`, the call an output cut by the token limit ends in (module doc), or None."""

    content: str | None
    calls: list[dict[str, Any]]
    cut_call: dict[str, Any] | None = None


def parse_output(plan: ToolPlan, text: str, cut: bool = False) -> ToolOutput:
    """The content and calls of a whole output under `plan` (`cut`: it was cut by the token limit)."""
    if plan.mode == "auto":
        return ToolOutput(*read_calls(plan.parser, text, plan.types, cut))
    stream = tool_stream(plan)
    stream.feed(text)
    stream.finish(cut)
    calls, last = stream.calls(), stream.cut_call()
    return ToolOutput(None, calls, last) if calls or last else ToolOutput(text, [])


def tool_stream(plan: ToolPlan) -> CallStream:
    """The reader of one streamed output's calls under `plan`."""
    return CallStream(plan.parser, plan.mode, plan.types, name=plan.name)
