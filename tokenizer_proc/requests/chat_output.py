"""A chat choice's output as the client reads it: reasoning (reasoning.py) first, then content and tool
calls (tools.py) read from what follows the reasoning. `message` is the whole answer's
`choices[i].message`; `ChoiceStream` turns the pieces of a streamed choice into delta fields."""

from __future__ import annotations

from typing import Any

from tokenizer_proc.requests.prepare import PreparedRequest
from tokenizer_proc.requests.reasoning import ReasoningStream, split_reasoning
from tokenizer_proc.requests.tool_parsers import CallStream
from tokenizer_proc.requests.tools import parse_output, tool_stream


def message(req: PreparedRequest, text: str, cut: bool = False) -> dict[str, Any]:
    """`choices[i].message` of a whole chat output (`cut`: by the token limit; tools.py)."""
    reasoning, rest = split_reasoning(req.reasoning, text)
    content: str | None = rest
    calls: list[dict[str, Any]] = []
    if req.tool_plan is not None:
        content, calls, last = parse_output(req.tool_plan, rest, cut)
        calls = calls + [last] if last is not None else calls
    if req.reasoning is not None and reasoning is not None and not content:
        content = None  # all of it was reasoning
    out: dict[str, Any] = {"role": "assistant", "content": content}
    if req.reasoning is not None:
        out["reasoning_content"] = reasoning if req.reasoning.include else None
    if calls:
        out["tool_calls"] = calls
    return out


class ChoiceStream:
    """One streamed chat choice: `feed` gives the delta fields of a new piece of text (reasoning_content,
    content, tool_calls; only those with something new), `called` whether it has made complete calls."""

    def __init__(self, req: PreparedRequest) -> None:
        self.reasoning = ReasoningStream(req.reasoning) if req.reasoning is not None else None
        self.tools: CallStream | None = tool_stream(req.tool_plan) if req.tool_plan is not None else None

    @property
    def called(self) -> bool:
        return self.tools is not None and any(entry[3] for entry in self.tools.sent)

    def feed(self, text: str, last: bool, cut: bool = False) -> dict[str, Any]:
        """`last`: the output ends with this piece; `cut`: by the token limit."""
        thought = ""
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(text)
            if last:
                more_thought, more = self.reasoning.finish()
                thought, text = thought + more_thought, text + more
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            text, calls = self.tools.feed(text)
            if last:
                rest, more_calls = self.tools.finish(cut)
                text, calls = text + rest, calls + more_calls
        out: dict[str, Any] = {}
        if thought and self.reasoning is not None and self.reasoning.plan.include:
            out["reasoning_content"] = thought
        if text:
            out["content"] = text
        if calls:
            out["tool_calls"] = calls
        return out
