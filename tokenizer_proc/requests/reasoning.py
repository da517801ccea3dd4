"""Reasoning output (`--reasoning-parser qwen3 | deepseek-r1 | nemotron`): the `<think> ... </think>` part
of a reasoning model's chat output comes back as `reasoning_content`, the rest as `content`.

Rules, the same for the three formats but for where the reasoning starts:
- the output is inside the reasoning from its start when the rendered prompt ends with `<think>`
  (the template opened it), or always for deepseek-r1 (its template opens it); it enters it when the
  output itself starts with `<think>`; a prompt ending with `</think>` (the template closed it, e.g.
  `chat_template_kwargs.enable_thinking: false`) means no reasoning at all;
- the reasoning ends at the first `</think>`; an output that never closes it is all reasoning when
  it started inside (cut by max_tokens, say), and all content when it never entered one;
- `reasoning_content` is the text between the tags without surrounding blank lines, `content` what
  follows `</think>` without leading ones (null when empty); tool calls are parsed from `content` only;
- `include_reasoning: false` (vLLM) drops the reasoning from the answer: `content` is what follows it;
- `separate_reasoning: false` (SGLang) keeps everything in `content`; streamed, `reasoning_content`
  deltas come as the reasoning does, unless `stream_reasoning: false` holds it for one delta when it
  ends;
- structured output and tool grammars constrain only what follows `</think>` (`grammar_after`);
- `thinking_token_budget: N` (vLLM) ends the reasoning after N tokens of it by forcing `</think>`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shared.messages import ThinkingBudget

START, END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek-r1", "nemotron")


@dataclass(frozen=True)
class ReasoningPlan:
    inside: bool  # the output starts inside the reasoning
    may_reason: bool  # the output can contain reasoning at all
    separate: bool = True
    stream: bool = True
    include: bool = True  # reasoning_content is returned (else dropped)


def plan_reasoning(parser: str, prompt: str, separate: bool = True, stream: bool = True, include: bool = True
                   ) -> ReasoningPlan | None:  # fmt: skip
    """How a chat request's output splits (None without a parser); `prompt`: the rendered prompt text."""
    if not parser:
        return None
    tail = prompt.rstrip()
    closed = tail.endswith(END)
    inside = not closed and (parser == "deepseek-r1" or tail.endswith(START))
    return ReasoningPlan(inside, not closed, separate, stream, include)


def grammar_after(plan: ReasoningPlan | None) -> str:
    """The text after which a grammar starts constraining the output ("" = from the start)."""
    return END if plan is not None and plan.may_reason and plan.separate else ""


def thinking_budget(plan: ReasoningPlan, tokens: int, encode: Callable[[str], list[int]]) -> ThinkingBudget | None:
    """The cap of `thinking_token_budget` (None when the output cannot reason: nothing to cap); the
    reasoning is ended with the parser's closing tag."""
    if not plan.may_reason:
        return None
    return ThinkingBudget(tokens=tokens, start=tuple(encode(START)), end=tuple(encode(END)), inside=plan.inside)


def split_reasoning(plan: ReasoningPlan | None, text: str) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole output."""
    if plan is None or not plan.separate or not plan.may_reason:
        return None, text
    body, inside = text, plan.inside
    if not inside and text.lstrip().startswith(START):
        body, inside = text.lstrip()[len(START):], True
    if not inside:
        return None, text
    reasoning, found, content = body.partition(END)
    if not found:
        return reasoning.strip("\n") or None, ""
    return reasoning.strip("\n") or None, content.lstrip("\n")


class ReasoningStream:
    """One streamed choice's text: `feed` returns the (reasoning, content) that can be sent now (never a
    possible start of a tag); `finish` the rest."""

    def __init__(self, plan: ReasoningPlan) -> None:
        self.plan = plan
        self.held = ""
        self.state = "inside" if plan.inside else ("start" if plan.may_reason else "content")
        self.reasoning_held = ""  # the reasoning so far, with stream_reasoning false
        self.lead = False  # content right after </think>: its leading blank lines are dropped
        self.reasoning_lead = True  # the reasoning's own leading blank lines are dropped

    def feed(self, text: str) -> tuple[str, str]:
        if not self.plan.separate or self.state == "content":
            return "", self._content(text)
        self.held += text
        if self.state == "start":
            stripped = self.held.lstrip()
            if stripped.startswith(START):
                self.held, self.state = stripped[len(START):], "inside"
            elif START.startswith(stripped):
                return "", ""  # may still become <think>
            else:
                self.state, rest, self.held = "content", self.held, ""
                return "", self._content(rest)
        before, found, after = self.held.partition(END)
        if found:
            self.held, self.state, self.lead = "", "content", True
            return self._reasoning(before.rstrip("\n"), last=True), self._content(after)
        keep = next((k for k in range(min(len(END) - 1, len(self.held)), 0, -1) if self.held.endswith(END[:k])), 0)
        keep += len(self.held[: len(self.held) - keep]) - len(self.held[: len(self.held) - keep].rstrip("\n"))
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return self._reasoning(out, last=False), ""  # trailing blank lines wait: they may end the reasoning

    def finish(self) -> tuple[str, str]:
        rest, self.held = self.held, ""
        if self.state == "content":
            return "", self._content(rest)
        if self.state == "start":
            return "", self._content(rest)
        return self._reasoning(rest, last=True), ""

    def _reasoning(self, text: str, last: bool) -> str:
        if self.reasoning_lead:
            text = text.lstrip("\n")
            self.reasoning_lead = not text
        if self.plan.stream:
            return text
        self.reasoning_held += text
        if not last:
            return ""
        out, self.reasoning_held = self.reasoning_held, ""
        return out

    def _content(self, text: str) -> str:
        if self.lead:
            text = text.lstrip("\n")
            self.lead = not text
        return text
