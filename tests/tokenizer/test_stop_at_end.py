"""Stop strings where a longer stop starts before a shorter one: the output is cut before the
stop that starts first in the whole text, even when that is only known when the output ends."""

from __future__ import annotations

import httpx

from tests.tokenizer.conftest import FakeBackend, text_plan
from tests.tokenizer.test_app import serve, sse_events
from tokenizer_proc.requests.detokenizer import StopStringMatcher
from tokenizer_proc.requests.tokenizer import TextTokenizer


def _run(matcher: StopStringMatcher, pieces: list[str]) -> str:
    out = []
    for p in pieces:
        out.append(matcher.push(p))
        matcher.check_integrity()
    return "".join(out) + matcher.finish()


def test_earlier_longer_stop_wins_over_a_later_complete_one() -> None:
    m = StopStringMatcher(["a", "bcaé"])
    assert _run(m, ["b", "ca", "é"]) == "" and m.matched == "bcaé"
    m = StopStringMatcher(["a", "bcaé"])  # the longer one never completes: cut before "a"
    assert _run(m, ["b", "ca", "x"]) == "bc" and m.matched == "a"
    m = StopStringMatcher(["a", "bcaé"])  # the text ends while the longer one is still possible
    assert _run(m, ["xb", "ca"]) == "xbc" and m.matched == "a"


def test_same_start_decides_at_once() -> None:
    m = StopStringMatcher(["a", "ab"])
    assert m.push("xa") == "x" and m.matched == "a"


def test_stop_known_only_at_the_end_is_a_stop_finish(args, backend: FakeBackend, tok: TextTokenizer) -> None:
    """The scheduler ends the request by length while the held tail still decides a stop string:
    the reply is a "stop" with the matched string, on both APIs."""
    backend.plan = text_plan("xbca", per_out=1)

    async def check(c: httpx.AsyncClient) -> None:
        sp = {"max_new_tokens": 4, "stop": ["a", "bcaz"]}
        r = (await c.post("/generate", json={"text": "q", "sampling_params": sp})).json()
        assert r["text"] == "xbc"
        assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": "a"}
        body = {"prompt": "q", "max_tokens": 4, "stop": ["a", "bcaz"], "stream": True}
        events = sse_events((await c.post("/v1/completions", json=body)).text)
        assert "".join(e["choices"][0]["text"] for e in events) == "xbc"
        assert events[-1]["choices"][0]["finish_reason"] == "stop"

    serve(args, backend, tok, check)
