"""The mixed request traffic of soak.py: what each request is, and how one is sent.

A request is drawn from ``random.Random`` with the weights in ``MIX``:
- ``short``: /v1/completions of a few words, streamed or not;
- ``long``: a chat turn of 80-160 words (the built-in tokenizer makes ~0.5-1k tokens of them);
- ``prefix``: one of ``PREFIX_GROUPS`` long system prompts plus a distinct question (prefix-cache reuse);
- ``cut``: a streamed chat turn the client closes after 0-5 chunks (the server must abort it);
- ``n``: a chat turn with ``n`` in 2..4;
- ``json``: a chat turn with ``response_format`` of type ``json_schema``;
- ``tools``: a chat turn offering two functions, ``tool_choice`` auto or required.
A sent request ends as ``ok`` (HTTP 200 and a complete body or stream), ``cut`` (closed by the client
as planned) or ``failed`` (anything else, with the reason kept).
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field

import httpx

logger = logging.getLogger(__name__)

MIX: dict[str, float] = {"short": 3, "long": 1, "prefix": 2, "cut": 2, "n": 1, "json": 1, "tools": 1}
PREFIX_GROUPS = 4
WORDS = ("state space model memory cache token prefix server stream batch layer kernel scheduler worker "
         "river mountain cloud garden number letter window paper engine signal").split()  # fmt: skip
JSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "count": {"type": "integer"}, "tags": {"type": "array",
                   "items": {"type": "string"}}},  # fmt: skip
    "required": ["name", "count"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "description": "Sum of two integers",
     "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}},
]  # fmt: skip


@dataclass(frozen=True)
class SoakRequest:
    """One planned request: its kind, endpoint, body, and (for ``cut``) after how many chunks to close."""

    kind: str
    path: str
    body: dict[str, object]
    cut_after: int | None = None


@dataclass
class WaveTally:
    """Outcomes of one wave, per request kind: counts of ok / cut / failed, and the first errors."""

    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def add(self, kind: str, outcome: str, error: str = "") -> None:
        per = self.counts.setdefault(kind, {"ok": 0, "cut": 0, "failed": 0})
        per[outcome] += 1
        if error and len(self.errors) < 10:
            self.errors.append(f"{kind}: {error}"[:300])

    def total(self, outcome: str) -> int:
        return sum(c[outcome] for c in self.counts.values())


def _words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def prefix_texts(seed: int) -> list[str]:
    """The shared system prompts (fixed for a seed, so every wave reuses the same prefixes)."""
    rng = random.Random(seed + 7919)
    return [f"You are assistant {g}. " + _words(rng, 100, 140) for g in range(PREFIX_GROUPS)]


def draw_request(rng: random.Random, model: str, prefixes: list[str]) -> SoakRequest:
    """One request of the mix, fully determined by the rng state."""
    kind = rng.choices(list(MIX), weights=list(MIX.values()))[0]
    max_tokens = rng.randint(4, 32)
    if kind == "short":
        body: dict[str, object] = {"model": model, "prompt": _words(rng, 2, 12), "max_tokens": max_tokens,
                                   "stream": rng.random() < 0.5, "temperature": rng.choice([0.0, 0.8])}  # fmt: skip
        return SoakRequest(kind, "/v1/completions", body)
    messages: list[dict[str, str]] = [{"role": "user", "content": _words(rng, 3, 20)}]
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.7}
    cut_after = None
    if kind == "long":
        messages[0]["content"] = _words(rng, 80, 160)
    elif kind == "prefix":
        messages.insert(0, {"role": "system", "content": rng.choice(prefixes)})
    elif kind == "cut":
        body.update(stream=True, max_tokens=rng.randint(16, 48))
        cut_after = rng.randint(0, 5)
    elif kind == "n":
        body["n"] = rng.randint(2, 4)
    elif kind == "json":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "item", "schema": JSON_SCHEMA}}
    elif kind == "tools":
        body.update(tools=TOOLS, tool_choice=rng.choice(["auto", "required"]))
    if kind != "cut" and rng.random() < 0.3:
        body.update(stream=True)
    return SoakRequest(kind, "/v1/chat/completions", body, cut_after)


async def send(client: httpx.AsyncClient, req: SoakRequest, tally: WaveTally) -> None:
    """Send one request and record its outcome in tally; never raises."""
    try:
        if req.body.get("stream"):
            outcome = await _send_stream(client, req)
        else:
            resp = await client.post(req.path, json=req.body)
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
            if not resp.json().get("choices"):
                raise RuntimeError(f"no choices in {resp.text[:200]}")
            outcome = "ok"
        tally.add(req.kind, outcome)
    except Exception as exc:  # one failed request must not stop the soak
        tally.add(req.kind, "failed", f"{type(exc).__name__}: {exc}")


async def _send_stream(client: httpx.AsyncClient, req: SoakRequest) -> str:
    """"cut" when the client closed the stream as planned, "ok" when it read it to [DONE]."""
    chunks = 0
    async with client.stream("POST", req.path, json=req.body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}")
        async for line in resp.aiter_lines():
            if req.cut_after is not None and chunks >= req.cut_after:
                return "cut"  # leaving the block closes the connection mid-stream
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                return "ok"
            doc = json.loads(data)
            if "error" in doc:
                raise RuntimeError(f"error in stream: {doc['error']}")
            chunks += 1
    if req.cut_after is not None:
        return "cut"  # the stream ended before the planned cut: a short answer, still a clean close
    raise RuntimeError("stream ended without [DONE]")
