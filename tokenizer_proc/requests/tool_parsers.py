"""Reading tool calls out of a chat output (`--tool-call-parser`), whole or as it streams.

Formats (the supported families' own): `<tool_call>{"name", "arguments"}</tool_call>` (hermes / qwen25:
Qwen, Granite 4; one block per call, a block may also hold a list), `<tool_call><function=NAME>
<parameter=KEY>VALUE</parameter>...</function></tool_call>` (qwen3_coder; a value is JSON unless its
parameter's schema type is string), `<|tool_call|>[...]` (granite: Granite 3) and
`<TOOLCALL>[...]</TOOLCALL>` (nemotron); "auto" reads every one of them. Inside `<tool_call>` either
JSON or the XML form is read, whichever the block holds.

Whole outputs: `parse_calls` gives (content outside the calls or None, calls); an output whose calls
do not parse is all content. Streamed (`CallStream`): text before the first call is content as it comes
(never a possible start of a call tag); a call's first delta carries its id, type and name as soon as
the name is complete (with the arguments so far), then its arguments follow as fragments of their
JSON text as it grows (held back where what follows could still be the end of the call); XML calls
send their arguments in one fragment when the call is complete. The fragments of a call add up to its
`arguments`, as in the whole answer.

An output cut by the token limit (`cut`): its complete calls are read as usual, and the call it was cut
in, once its name is complete, is read too, as `CallStream.cut_call` / the third item of `read_calls`:
its `arguments` are the JSON text written so far (`{"a": 70`, or "" before any), an XML call's the JSON
object of its complete parameters left open (`{"city": "Paris"`); it never counts among the complete
calls. A call cut before its name is complete is not read (as in any output: no call at all is content).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

TAGS = {"hermes": ("<tool_call>",), "qwen25": ("<tool_call>",), "qwen3_coder": ("<tool_call>",),
        "granite": ("<|tool_call|>",), "nemotron": ("<TOOLCALL>",),
        "auto": ("<tool_call>", "<|tool_call|>", "<TOOLCALL>")}  # fmt: skip
END_TAGS = {"<tool_call>": "</tool_call>", "<TOOLCALL>": "</TOOLCALL>", "<|tool_call|>": ""}
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)
_DECODER = json.JSONDecoder()


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class Partial:
    """A call as read so far: its name (None until complete in the text), its arguments' JSON text
    (complete when `done`, else the part that cannot change), and whether it is complete."""

    name: str | None
    args: str
    done: bool


def _skip(text: str, i: int, chars: str = " \t\r\n,[") -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


def json_calls(text: str, whole: bool = False) -> list[Partial]:
    """The calls of a JSON object or list of objects `{"name", "arguments"}`, the last one maybe partial
    (`whole`: `text` ends there, so a partial call's string arguments count as written so far)."""
    out: list[Partial] = []
    i = _skip(text, 0)
    while i < len(text) and text[i] == "{":
        try:
            obj, end = _DECODER.raw_decode(text, i)
        except json.JSONDecodeError:
            name = _NAME.search(text, i)
            args = _ARGS.search(text, i)
            value = text[args.end():] if args else ""
            stable = "" if value.startswith('"') and not whole else _value_prefix(value)  # strings: sent whole
            out.append(Partial(name.group(1) if name else None, stable, False))
            return out
        if not isinstance(obj, dict):
            return out
        raw = "{}"
        args = _ARGS.search(text, i, end)
        if args is not None:
            try:
                value, vend = _DECODER.raw_decode(text, args.end())
                raw = value if isinstance(value, str) else text[args.end():vend]
            except json.JSONDecodeError:
                pass
        name = obj.get("name")
        out.append(Partial(name if isinstance(name, str) else None, raw, True))
        i = _skip(text, end)
    return out


def _value_prefix(text: str) -> str:
    """The part of a JSON value at the start of `text` that is surely its own: all of it once its
    brackets close, else everything so far (nothing of what follows can be in it yet)."""
    depth, in_string, escape = 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            escape, in_string = (False, True) if escape else (ch == "\\", ch != '"')
            continue
        if ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth <= 0:
                return text[: i + 1]
    return text.rstrip()


def _xml_call(text: str, done: bool, types: dict[str, dict[str, str]], cut: bool = False) -> Partial:
    """An XML call; one not `done` has no arguments yet, unless `cut`: then its complete parameters'
    JSON object, left open."""
    fn = _FUNCTION.search(text)
    name = fn.group(1).strip() if fn else None
    if name is None or not (done or cut):
        return Partial(name, "", False)
    args = json.dumps(_xml_args(text, types.get(name, {})))
    return Partial(name, args if done else args[:-1], done)


def _xml_args(text: str, kinds: dict[str, str]) -> dict[str, Any]:
    args: dict[str, Any] = {}
    for key, value in _PARAM.findall(text):
        key = key.strip()
        if kinds.get(key) == "string":
            args[key] = value
            continue
        try:
            args[key] = json.loads(value)
        except json.JSONDecodeError:
            args[key] = value
    return args


def scan(text: str, tags: tuple[str, ...], types: dict[str, dict[str, str]], final: bool,
         cut: bool = False) -> list[Partial]:  # fmt: skip
    """The calls in `text`, which starts at the first call tag (`final`: the output is complete; `cut`:
    it was cut by the token limit, and the call it ends in is kept if it has a name)."""
    out: list[Partial] = []
    at = 0
    while at < len(text):
        tag = next((t for t in tags if text.startswith(t, at)), None)
        if tag is None:
            break
        start, end_tag = at + len(tag), END_TAGS[tag]
        close = text.find(end_tag, start) if end_tag else -1
        block = text[start:close] if close >= 0 else text[start:]
        done, cut_here = close >= 0 or final, cut and close < 0
        if block.lstrip().startswith("<function="):  # complete only once closed, even in a final output
            call = _xml_call(block, close >= 0 or "</function>" in block, types, cut=cut_here)
            out.extend([call] if call.name is not None or not cut_here else [])
        else:
            calls = json_calls(block, whole=cut_here)
            if done:
                calls = [c for c in calls if c.done or (cut_here and c.name is not None)]
            out.extend(calls)
        if close < 0:
            break
        at = _skip(text, close + len(end_tag), " \t\r\n")
    return out


def param_types(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, str]]:
    """Per function, the schema type of each parameter (what the XML form needs to read values)."""
    out: dict[str, dict[str, str]] = {}
    for t in tools or []:
        fn = t.get("function", t)
        props = (fn.get("parameters") or {}).get("properties") or {}
        out[fn.get("name", "")] = {k: v.get("type", "") for k, v in props.items() if isinstance(v, dict)}
    return out


def _first_tag(text: str, tags: tuple[str, ...]) -> int:
    return min((i for i in (text.find(t) for t in tags) if i >= 0), default=-1)


def _as_call(p: Partial) -> dict[str, Any]:
    return {"id": call_id(), "type": "function", "function": {"name": p.name, "arguments": p.args}}


def parse_calls(parser: str, text: str, types: dict[str, dict[str, str]]) -> tuple[str | None, list[dict[str, Any]]]:
    """(content outside the calls or None, calls) of a whole `auto` output; no calls when none parses."""
    content, calls, _ = read_calls(parser, text, types)
    return content, calls


def read_calls(parser: str, text: str, types: dict[str, dict[str, str]],
               cut: bool = False) -> tuple[str | None, list[dict[str, Any]], dict[str, Any] | None]:  # fmt: skip
    """(content outside the calls or None, complete calls, the call a `cut` output ends in or None) of a
    whole `auto` output; all of it is content when a call does not parse, or there is none."""
    tags = TAGS[parser]
    at = _first_tag(text, tags)
    if at < 0:
        return text, [], None
    partials = scan(text[at:], tags, types, final=True, cut=cut)
    last = partials.pop() if cut and partials and not partials[-1].done else None
    if not (partials or last) or any(not p.done or not p.name for p in partials):
        return text, [], None
    tail = "" if last is not None else _tail(text[at:], tags)  # before a cut call: only blanks
    content = (text[:at] + tail).strip()
    return content or None, [_as_call(p) for p in partials], _as_call(last) if last is not None else None


def _tail(region: str, tags: tuple[str, ...]) -> str:
    """Text after the last closed call block (a list format runs to the end)."""
    ends = [region.rfind(END_TAGS[t]) + len(END_TAGS[t]) for t in tags if END_TAGS[t] and END_TAGS[t] in region]
    return region[max(ends):] if ends else ""


@dataclass
class CallStream:
    """One streamed output's calls (module doc). `mode`: "auto" (tags), "named" (the whole output is
    one call's arguments), "required" (the whole output is a JSON list of calls)."""

    parser: str
    mode: str
    types: dict[str, dict[str, str]]
    name: str | None = None  # the named call's function
    held: str = ""
    region: str | None = None  # the text from the first call on
    sent: list[list[Any]] = field(default_factory=list)  # per call: [id, name, arguments text sent, complete]
    cut_index: int | None = None  # the call a cut output ends in (finish)

    def __post_init__(self) -> None:
        if self.mode in ("named", "required"):
            self.region = ""

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content that can be sent now, tool-call deltas)."""
        if self.region is None:
            self.held += text
            tags = TAGS[self.parser]
            at = _first_tag(self.held, tags)
            if at < 0:
                keep = max((k for t in tags for k in range(1, len(t)) if self.held.endswith(t[:k])), default=0)
                out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep:]
                return out, []
            out, self.region, self.held = self.held[:at], self.held[at:], ""
            return out, self._deltas(self._partials(final=False))
        self.region += text
        return "", self._deltas(self._partials(final=False))

    def finish(self, cut: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """(the rest of the content, the last deltas) once the output is complete (`cut`: by the token
        limit; the call it ends in then gets the rest of its arguments so far, see `cut_call`)."""
        if self.region is None:
            rest, self.held = self.held, ""
            return rest, []
        partials = [p for p in self._partials(final=True, cut=cut) if p.name and (p.done or cut)]
        if not partials and not self.sent:
            return self.region, []
        if cut and partials and not partials[-1].done:
            self.cut_index = len(partials) - 1
        tail = _tail(self.region, TAGS[self.parser]) if self.mode == "auto" and self.cut_index is None else ""
        return tail.strip(), self._deltas(partials)

    def _partials(self, final: bool, cut: bool = False) -> list[Partial]:
        assert self.region is not None
        if self.mode == "named":
            text = self.region
            if final:
                try:
                    json.loads(text)
                except json.JSONDecodeError:
                    return [Partial(self.name, text.strip(), False)] if cut else []
            return [Partial(self.name, text.strip() if final else _value_prefix(text.lstrip()), final)]
        if self.mode == "required":
            calls = json_calls(self.region, whole=cut)
            return [c for c in calls if c.done or (cut and c.name is not None)] if final else calls
        return scan(self.region, TAGS[self.parser], self.types, final, cut)

    def _deltas(self, partials: list[Partial]) -> list[dict[str, Any]]:
        out = []
        for k, p in enumerate(partials):
            if p.name is None:
                break  # later calls wait for this one's header
            if k == len(self.sent):
                self.sent.append([call_id(), p.name, "", False])
                out.append({"index": k, "id": self.sent[k][0], "type": "function",
                            "function": {"name": p.name, "arguments": ""}})  # fmt: skip
            entry = self.sent[k]
            if len(p.args) > len(entry[2]) and p.args.startswith(entry[2]):
                fragment = p.args[len(entry[2]):]
                if out and out[-1]["index"] == k:  # one entry per call in a delta, as OpenAI sends them
                    out[-1]["function"]["arguments"] += fragment
                else:
                    out.append({"index": k, "function": {"arguments": fragment}})
                entry[2] = p.args
            entry[3] = p.done and entry[2] == p.args
        return out

    def calls(self) -> list[dict[str, Any]]:
        """The complete calls sent, as OpenAI tool_calls."""
        return [{"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
                for cid, name, args, done in self.sent if done]  # fmt: skip

    def cut_call(self) -> dict[str, Any] | None:
        """The call the output was cut in (`finish(cut=True)`), as sent: its arguments are incomplete."""
        if self.cut_index is None:
            return None
        cid, name, args, _ = self.sent[self.cut_index]
        return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
