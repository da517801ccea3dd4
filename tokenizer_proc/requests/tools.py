"""Tool calling on /v1/chat/completions: what the template gets, what constrains the output, and how
the output becomes OpenAI `tool_calls`.

- `tools` are passed to the chat template (OpenAI shape); assistant `tool_calls` in the history are
  given to it with `arguments` parsed to objects (templates render them as JSON), `tool` messages as
  they are.
- tool_choice `none`: no parsing, the output is content. `auto` (the default with tools): the output
  is parsed for calls in the formats of the supported families: `<tool_call>{"name", "arguments"}
  </tool_call>` (Granite 4, Hermes style; one block per call), `<|tool_call|>[...]` (Granite 3) and
  `<TOOLCALL>[...]</TOOLCALL>` (Nemotron). `required`: the output is constrained by grammar to a JSON
  array of calls `{"name", "arguments"}` (one element when parallel_tool_calls is false), each
  validating against its function's parameters; a named function: constrained to its arguments.
- A response with calls has `message.tool_calls` (`content` holds any text outside the calls, else
  null) and finish_reason "tool_calls". Streamed, content is sent as it comes until a call may start;
  the calls follow in one delta when the output is complete (`ToolStream`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from shared.messages import GrammarSpec
from tokenizer_proc.http.errors import bad_request
from tokenizer_proc.requests.schemas import ChatBody
from tokenizer_proc.requests.structured import json_schema_spec

START_TAGS = ("<tool_call>", "<|tool_call|>", "<TOOLCALL>")
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
_LIST_AFTER = {"<|tool_call|>": None, "<TOOLCALL>": "</TOOLCALL>"}


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses tools: `mode` "" (no tools or none), "auto", "required", "named"."""

    mode: str = ""
    name: str | None = None
    grammar: GrammarSpec | None = None
    template_tools: list[dict[str, Any]] | None = field(default=None, compare=False)


def plan_tools(body: ChatBody) -> ToolPlan:
    """Checks tools and tool_choice (400 naming the field) and the plan for the request."""
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


def _call(name: Any, arguments: Any) -> dict[str, Any] | None:
    if not isinstance(name, str) or not name:
        return None
    args = arguments if isinstance(arguments, str) else json.dumps(arguments if arguments is not None else {})
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


def _calls_of(items: Any) -> list[dict[str, Any]] | None:
    items = items if isinstance(items, list) else [items]
    calls = [_call(i.get("name"), i.get("arguments", i.get("parameters"))) if isinstance(i, dict) else None
             for i in items]
    return calls if calls and all(c is not None for c in calls) else None  # type: ignore[return-value]


def parse_tagged(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content outside the calls or None, calls) of an `auto` output; no calls when nothing parses."""
    at = min((i for i in (text.find(t) for t in START_TAGS) if i >= 0), default=-1)
    if at < 0:
        return text, []
    head, rest = text[:at], text[at:]
    calls: list[dict[str, Any]] | None = []
    tail = ""
    if rest.startswith("<tool_call>"):
        for m in _BLOCK.finditer(rest):
            got = _loads(m.group(1))
            found = _calls_of(got) if got is not None else None
            if found is None:
                return text, []
            calls += found  # type: ignore[operator]
        tail = _BLOCK.sub("", rest)
    else:
        tag = next(t for t in _LIST_AFTER if rest.startswith(t))
        body = rest[len(tag):]
        end = _LIST_AFTER[tag]
        if end and end in body:
            body, tail = body.split(end, 1)
        got = _loads(body)
        calls = _calls_of(got) if got is not None else None
        if calls is None:
            return text, []
    content = (head + tail).strip()
    return content or None, calls or []


def _loads(text: str) -> Any:
    try:
        return json.loads(text.strip())
    except json.JSONDecodeError:
        return None


def parse_output(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a whole output under `plan`."""
    if plan.mode == "auto":
        return parse_tagged(text)
    if plan.mode == "named":
        got = _loads(text)
        if isinstance(got, dict):
            return None, [c for c in [_call(plan.name, got)] if c is not None]
        return text, []
    if plan.mode == "required":
        got = _loads(text)
        calls = _calls_of(got) if isinstance(got, list) else None
        return (None, calls) if calls else (text, [])
    return text, []


class ToolStream:
    """One streamed choice's text under a tool plan: `feed` returns the content that can be sent
    now (never a possible start of a call); `finish` the rest and the calls."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan, self.held, self.calling = plan, "", plan.mode in ("required", "named")

    def feed(self, text: str) -> str:
        self.held += text
        if self.calling or self.plan.mode != "auto":
            return ""
        at = min((i for i in (self.held.find(t) for t in START_TAGS) if i >= 0), default=-1)
        if at >= 0:
            self.calling = True
            out, self.held = self.held[:at], self.held[at:]
            return out
        keep = max((k for t in START_TAGS for k in range(1, len(t)) if self.held.endswith(t[:k])), default=0)
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep:]
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        content, calls = parse_output(self.plan, self.held)
        return content or "", calls
