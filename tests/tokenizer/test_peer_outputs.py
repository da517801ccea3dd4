"""vLLM / SGLang request fields that shape the answer, against a fake backend: prompt_logprobs,
return_token_ids, stream_options.continuous_usage_stats, completions logprobs=0, and SGLang's
stop_regex (whole, streamed, /generate, and the matcher itself)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import pytest

from shared.messages import GenerateReq, TokenOut
from tests.tokenizer.conftest import EOS, FakeBackend, text_plan
from tests.tokenizer.test_app import serve, sse_events
from tokenizer_proc.requests.stop_regex import StopRegexBudgetExceeded, StopRegexMatcher

COMP, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]


class RankedBackend(FakeBackend):
    """FakeBackend whose first output also carries prompt ranks (rank 3 for every prompt token)."""

    async def submit(self, req: GenerateReq) -> AsyncIterator[TokenOut]:
        async for out in super().submit(req):
            if out.prompt_logprobs is not None:
                out = msgspec.structs.replace(out, prompt_ranks=[3] * len(out.prompt_logprobs))
            yield out


def _run(args, tok, backend: FakeBackend, calls: list[tuple[str, dict]]) -> list[httpx.Response]:
    out: list[httpx.Response] = []

    async def check(c: httpx.AsyncClient) -> None:
        for path, body in calls:
            out.append(await c.post(path, json=body))

    serve(args, backend, tok, check)
    return out


def _entry(tok, t: int, lp: float, rank: int | None) -> dict[str, Any]:
    return {"logprob": lp, "rank": rank, "decoded_token": tok.token_text(t)}


def test_prompt_logprobs_completions_and_chat(args, tok) -> None:
    prompt = [ord("a"), ord("b"), ord("c")]
    comp, chat, zero = _run(args, tok, RankedBackend(), [
        (COMP, {"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 1}),
        (CHAT, {"messages": MSGS, "max_tokens": 2, "prompt_logprobs": 2}),
        (COMP, {"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 0}),
    ])
    ch = comp.json()["choices"][0]
    assert ch["prompt_logprobs"] == [None, {"98": _entry(tok, 98, -1.0, 3)}, {"99": _entry(tok, 99, -1.0, 3)}]
    assert ch["logprobs"] is None and ch["text"] == "he"
    body = chat.json()
    assert "prompt_logprobs" not in body["choices"][0]
    plp = body["prompt_logprobs"]
    chat_ids = tok.encode(tok.render_chat(MSGS), add_special_tokens=False)
    assert len(plp) == len(chat_ids) and plp[0] is None
    assert all(list(e) == [str(t)] for e, t in zip(plp[1:], chat_ids[1:], strict=True))
    assert zero.json()["choices"][0]["prompt_logprobs"][1] == {"98": _entry(tok, 98, -1.0, 3)}


def test_prompt_logprobs_rank_from_alternatives_and_streaming(args, tok) -> None:
    prompt = [ord("x"), ord("y")]
    whole, stream = _run(args, tok, FakeBackend(), [  # this backend gives no ranks
        (COMP, {"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 1}),
        (COMP, {"prompt": prompt, "max_tokens": 3, "prompt_logprobs": 1, "stream": True}),
    ])
    want = [None, {"121": _entry(tok, 121, -1.0, 1)}]  # the prompt token is the only alternative: rank 1
    assert whole.json()["choices"][0]["prompt_logprobs"] == want
    events = sse_events(stream.text)
    assert events[0]["choices"][0]["prompt_logprobs"] == want
    assert all("prompt_logprobs" not in e["choices"][0] for e in events[1:])


def test_prompt_logprobs_with_echo_logprobs_and_range(args, tok) -> None:
    backend = FakeBackend()
    both, low, high = _run(args, tok, backend, [
        (COMP, {"prompt": [5, 6], "max_tokens": 1, "echo": True, "logprobs": 0, "prompt_logprobs": 2}),
        (CHAT, {"messages": MSGS, "prompt_logprobs": -1}),
        (COMP, {"prompt": "a", "prompt_logprobs": 21}),
    ])
    assert backend.submitted[0].sampling.prompt_logprobs == 2
    ch = both.json()["choices"][0]
    assert ch["logprobs"]["top_logprobs"][:2] == [None, {tok.token_text(6): -1.0}]  # echo's part: logprobs=0
    assert len(ch["prompt_logprobs"]) == 2
    for r in (low, high):
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_logprobs_zero_gives_the_sampled_token(args, tok) -> None:
    (r,) = _run(args, tok, FakeBackend(), [(COMP, {"prompt": "a", "max_tokens": 3, "logprobs": 0})])
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["h", "e", "l"] and lp["token_logprobs"] == [-0.5] * 3
    assert lp["top_logprobs"] == [{"h": -0.5}, {"e": -0.5}, {"l": -0.5}]


def test_return_token_ids(args, tok) -> None:
    comp, chat, cstream, chstream = _run(args, tok, FakeBackend(plan=text_plan("hello", per_out=2)), [
        (COMP, {"prompt": [7, 8], "max_tokens": 4, "return_token_ids": True, "n": 2}),
        (CHAT, {"messages": MSGS, "max_tokens": 3, "return_token_ids": True}),
        (COMP, {"prompt": [7, 8], "max_tokens": 4, "return_token_ids": True, "stream": True}),
        (CHAT, {"messages": MSGS, "max_tokens": 3, "return_token_ids": True, "stream": True}),
    ])
    for ch in comp.json()["choices"]:
        assert ch["prompt_token_ids"] == [7, 8] and ch["token_ids"] == list(b"hell")
    chat_ids = tok.encode(tok.render_chat(MSGS), add_special_tokens=False)
    body = chat.json()
    assert body["prompt_token_ids"] == chat_ids and body["choices"][0]["token_ids"] == list(b"hel")
    events = sse_events(cstream.text)
    assert events[0]["choices"][0]["prompt_token_ids"] == [7, 8]
    assert all("prompt_token_ids" not in e["choices"][0] for e in events[1:])
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == list(b"hell")
    events = sse_events(chstream.text)
    assert events[0]["prompt_token_ids"] == chat_ids and all("prompt_token_ids" not in e for e in events[1:])
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == list(b"hel")


def test_token_ids_of_chunks_without_text(args, tok) -> None:
    """A chunk whose tokens make no text yet (half a character) still sends its token ids."""
    data = "é".encode()
    backend = FakeBackend(plan=lambda req: [[data[0]], [data[1]], [ord("!")]])
    (r,) = _run(args, tok, backend, [(COMP, {"prompt": "a", "max_tokens": 3, "stream": True,
                                               "return_token_ids": True})])
    events = sse_events(r.text)
    assert [e["choices"][0]["token_ids"] for e in events] == [[data[0]], [data[1]], [ord("!")]]
    assert "".join(e["choices"][0]["text"] for e in events) == "é!"


def test_continuous_usage_stats(args, tok) -> None:
    opts = {"continuous_usage_stats": True}
    comp, chat, off = _run(args, tok, FakeBackend(plan=text_plan("hello", per_out=1)), [
        (COMP, {"prompt": [1, 2, 3], "max_tokens": 4, "stream": True, "stream_options": opts}),
        (CHAT, {"messages": MSGS, "max_tokens": 3, "stream": True, "n": 2, "stream_options": opts}),
        (COMP, {"prompt": [1], "max_tokens": 2, "stream": True,
                "stream_options": {**opts, "include_usage": False}}),
    ])
    events = sse_events(comp.text)
    assert [e["usage"]["completion_tokens"] for e in events[:-1]] == [1, 2, 3, 4]
    assert all(e["usage"]["prompt_tokens"] == 3 and e["usage"]["total_tokens"] == 3 + e["usage"]["completion_tokens"]
               for e in events)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4  # the final usage chunk
    events = sse_events(chat.text)
    per_choice: dict[int, list[int]] = {0: [], 1: []}
    for e in events[:-1]:
        per_choice[e["choices"][0]["index"]].append(e["usage"]["completion_tokens"])
    assert per_choice == {0: [1, 2, 3], 1: [1, 2, 3]}  # each chunk: its own choice's tokens so far
    assert events[-1]["usage"]["completion_tokens"] == 6
    assert all("usage" not in e for e in sse_events(off.text))


def test_stop_regex_whole_streamed_and_native(args, tok) -> None:
    backend = FakeBackend(plan=text_plan("one two three four ", per_out=3))
    comp, chat, stream, native, bad = _run(args, tok, backend, [
        (COMP, {"prompt": "a", "max_tokens": 30, "stop_regex": r"t[a-z]+e"}),
        (CHAT, {"messages": MSGS, "max_tokens": 30, "stop_regex": [r"zz", r"w\w"]}),
        (COMP, {"prompt": "a", "max_tokens": 30, "stop_regex": r"thr+ee", "stream": True}),
        ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 30, "stop_regex": "f.u"}}),
        (COMP, {"prompt": "a", "stop_regex": "a("}),
    ])
    ch = comp.json()["choices"][0]
    assert (ch["text"], ch["finish_reason"], ch["matched_stop"]) == ("one two ", "stop", r"t[a-z]+e")
    ch = chat.json()["choices"][0]
    assert (ch["message"]["content"], ch["finish_reason"], ch["matched_stop"]) == ("one t", "stop", r"w\w")
    events = sse_events(stream.text)
    assert "".join(e["choices"][0]["text"] for e in events) == "one two "
    assert events[-1]["choices"][0]["matched_stop"] == r"thr+ee"
    meta = native.json()["meta_info"]
    assert native.json()["text"] == "one two three " and meta["finish_reason"] == {"type": "stop", "matched": "f.u"}
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stop_regex"
    assert len(backend.aborted) == 4  # each match aborts the request at the scheduler


@pytest.mark.parametrize(("value", "param"), [
    ("a*", "stop_regex"), ("", "stop_regex"), (["x"] * 17, "stop_regex"),
])
def test_bad_stop_regex(args, tok, value, param) -> None:
    (r, g) = _run(args, tok, FakeBackend(), [
        (COMP, {"prompt": "a", "stop_regex": value}),
        ("/generate", {"text": "a", "sampling_params": {"stop_regex": value}}),
    ])
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert g.status_code == 400 and g.json()["error"]["param"] == "sampling_params." + param


def test_stop_regex_matcher_holds_possible_matches() -> None:
    m = StopRegexMatcher([r"and|or"])
    assert [m.push(t) for t in ("x a", "n", "t a", "nd z")] == ["x ", "", "ant ", ""]
    assert m.matched == "and|or" and m.finish() == ""
    m.check_integrity()
    m = StopRegexMatcher([r"b+c"])
    assert m.push("abb") == "a" and m.finish() == "bb" and m.matched is None  # never completed
    m = StopRegexMatcher([r"[.!?]\s*$", r"(?<=x)y"])  # anchors and lookbehinds see the released text
    assert m.push("Hi") == "Hi" and m.push(" x") == " x" and m.push("y!") == "" and m.matched == r"(?<=x)y"
    m = StopRegexMatcher([r"[.!?]\s*$"])
    assert m.push("Hi") == "Hi" and m.push(".") == "" and m.matched == r"[.!?]\s*$"


def test_stop_regex_searches_share_one_budget_per_request() -> None:
    """Every search of a request draws on one budget: a pattern that backtracks without end ends the
    request within it, however many tokens each search was cheap enough for."""
    m = StopRegexMatcher(["(.*a){12}Q"], budget_s=0.2)
    start = time.perf_counter()
    with pytest.raises(StopRegexBudgetExceeded, match="stop_regex"):
        for _ in range(5000):
            m.push("a bat ")
    assert time.perf_counter() - start < 1.0
    assert m.spent_s == pytest.approx(0.2)
    m.check_integrity()
    with pytest.raises(StopRegexBudgetExceeded):  # spent: every later search is refused at once
        m.push("a")
    cheap = StopRegexMatcher(["xyz"], budget_s=0.2)
    assert "".join(cheap.push("a bat ") for _ in range(1000)) == "a bat " * 1000
    assert 0 < cheap.spent_s < 0.2


def test_a_stop_regex_over_budget_is_a_400_naming_it(args, tok) -> None:
    backend = FakeBackend(plan=lambda req: [[ord(c) for c in "a bat "]] * 400 + [[EOS]])
    whole, streamed = _run(args, tok, backend, [
        (COMP, {"prompt": "a", "max_tokens": 60, "stop_regex": "(.*a){12}Q"}),
        (COMP, {"prompt": "a", "max_tokens": 60, "stop_regex": "(.*a){12}Q", "stream": True}),
    ])
    assert whole.status_code == 400 and whole.json()["error"]["param"] == "stop_regex", whole.text
    frames = [ln[6:] for ln in streamed.text.splitlines() if ln.startswith("data: ")]
    assert frames[-1] == "[DONE]" and json.loads(frames[-2])["error"]["code"] == 400, frames[-2:]


def test_stop_string_and_regex_together(args, tok) -> None:
    backend = FakeBackend(plan=lambda req: [[ord(c) for c in "abcdef"], [EOS]])
    first_string, first_regex = _run(args, tok, backend, [
        (COMP, {"prompt": "a", "max_tokens": 8, "stop": "cd", "stop_regex": "e+f"}),
        (COMP, {"prompt": "a", "max_tokens": 8, "stop": "ef", "stop_regex": "b.d"}),
    ])
    assert first_string.json()["choices"][0]["matched_stop"] == "cd"
    assert first_string.json()["choices"][0]["text"] == "ab"
    assert first_regex.json()["choices"][0]["matched_stop"] == "b.d"
    assert first_regex.json()["choices"][0]["text"] == "a"
