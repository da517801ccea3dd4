"""Beam search (`use_beam_search`) against a fake scheduler whose "model" is a fixed pseudo-random
distribution of the prompt's last tokens: the answer equals a plain beam search written here (every
candidate scored, no early stop), on completions and chat; the step requests are one-token greedy
requests over the beam's tokens; streamed, each beam comes whole at the end; the refusals name their
field; a client that leaves aborts the outstanding step requests."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator

import numpy as np
import pytest

from shared.messages import GenerateReq, TokenOut
from tests.tokenizer.conftest import EOS, FakeBackend
from tests.tokenizer.test_app import serve, sse_events
from tests.tokenizer.test_disconnect import FakeConnection, _scope
from tokenizer_proc import create_app

COMP, CHAT = "/v1/completions", "/v1/chat/completions"
VOCAB = 260


def toy_logprobs(ids: list[int]) -> np.ndarray:
    """The fake model: log-softmax of logits drawn from a generator seeded by the last two tokens; EOS
    made likely enough to end some beams."""
    rng = np.random.default_rng(ids[-1] * 1009 + (ids[-2] if len(ids) > 1 else 7))
    logits = rng.normal(0.0, 2.0, VOCAB)
    logits[EOS] += 3.0
    logits -= logits.max()
    return logits - math.log(np.exp(logits).sum())


class ToyBackend(FakeBackend):
    """Answers each request with one greedy token of `toy_logprobs` and its top_logprobs; a request whose
    rid ends with `abort_suffix` is aborted by the "scheduler" instead."""

    abort_suffix: str = "never"

    async def submit(self, req: GenerateReq) -> AsyncIterator[TokenOut]:
        self.submitted.append(req)
        self.open_streams.add(req.rid)
        try:
            if self.gate is not None:
                await self.gate.wait()
            await asyncio.sleep(0)
            if req.rid.endswith(self.abort_suffix):
                self.finished.append(req.rid)
                yield TokenOut(rid=req.rid, token_ids=[], finished=True, finish_reason="abort", error="aborted")
                return
            lp = toy_logprobs(req.input_ids)
            order = sorted(range(VOCAB), key=lambda t: (-lp[t], t))
            tops = [[(t, float(lp[t])) for t in order[: req.sampling.top_logprobs]]]
            self.finished.append(req.rid)
            yield TokenOut(rid=req.rid, token_ids=[order[0]], finished=True, finish_reason="length",
                           prompt_tokens=len(req.input_ids), completion_tokens=1, cached_tokens=len(req.input_ids) - 1,
                           top_logprobs=tops if req.sampling.top_logprobs else None)  # fmt: skip
        finally:
            self.open_streams.discard(req.rid)


def reference(prompt: list[int], width: int, max_tokens: int, penalty: float) -> list[tuple[list[int], float, str]]:
    """Plain beam search: every step to max_tokens, the 2 x width best tokens of each live beam, EOS
    candidates finished, the width best others kept; the width best by cum / L ** penalty."""
    live: list[tuple[list[int], float]] = [([], 0.0)]
    done: list[tuple[list[int], float, str]] = []
    for _ in range(max_tokens):
        grown = []
        for toks, cum in live:
            lp = toy_logprobs(prompt + toks)
            for t in sorted(range(VOCAB), key=lambda t: (-lp[t], t))[: 2 * width]:
                if t == EOS:
                    done.append((toks, cum + float(lp[t]), "stop"))
                else:
                    grown.append((toks + [t], cum + float(lp[t])))
        grown.sort(key=lambda g: -g[1])
        live = grown[:width]
    done += [(toks, cum, "length") for toks, cum in live]
    return sorted(done, key=lambda d: -d[1] / (len(prompt) + len(d[0])) ** penalty)[:width]


def _post(args, tok, calls: list[tuple[str, dict]], backend: FakeBackend | None = None):
    backend = backend or ToyBackend()
    out = []

    async def check(c) -> None:
        for path, body in calls:
            out.append(await c.post(path, json=body))

    serve(args, backend, tok, check)
    return out, backend


@pytest.mark.parametrize("width", [1, 2, 4])
@pytest.mark.parametrize("penalty", [1.0, 0.5, 2.0])
def test_completion_beams_equal_a_plain_beam_search(args, tok, width: int, penalty: float) -> None:
    prompts = [[104, 105], [200, 3, 17]]
    body = {"prompt": prompts, "n": width, "max_tokens": 6, "use_beam_search": True, "length_penalty": penalty,
            "logprobs": 2, "return_token_ids": True, "temperature": 0.7}
    (r,), backend = _post(args, tok, [(COMP, body)])
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == list(range(len(choices)))
    ended_by_eos = 0
    for pi, prompt in enumerate(prompts):
        want = reference(prompt, width, 6, penalty)
        got = choices[pi * width:(pi + 1) * width]
        assert [c["token_ids"] for c in got] == [w[0] for w in want]
        assert [c["finish_reason"] for c in got] == [w[2] for w in want]
        for c, (toks, cum, reason) in zip(got, want, strict=True):
            lps = c["logprobs"]["token_logprobs"]
            eos_lp = cum - sum(lps)
            assert math.isclose(eos_lp, 0.0, abs_tol=1e-9) if reason == "length" else eos_lp < 0
            assert len(c["logprobs"]["top_logprobs"][0] or {}) <= 2 if toks else True
            ended_by_eos += reason == "stop"
    assert ended_by_eos > 0 or width == 1 or penalty > 1  # the EOS path is exercised
    for sub in backend.submitted:  # every step request: one greedy token and its 2 x width alternatives
        assert (sub.sampling.max_new_tokens, sub.sampling.temperature, sub.sampling.top_logprobs) == (1, 0.0, 2 * width)
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)
    assert usage["prompt_tokens"] == sum(len(p) for p in prompts)


def test_early_stop_sends_fewer_requests_and_changes_nothing(args, tok) -> None:
    """With length_penalty 0 the score is the cumulative logprob: once `width` beams have ended, the live
    ones can only fall, so the search stops well before max_tokens."""
    body = {"prompt": [104, 105], "n": 2, "max_tokens": 40, "use_beam_search": True, "length_penalty": 0.0,
            "return_token_ids": True}
    (r,), backend = _post(args, tok, [(COMP, body)])
    assert r.status_code == 200, r.text
    want = reference([104, 105], 2, 40, 0.0)
    assert [c["token_ids"] for c in r.json()["choices"]] == [w[0] for w in want]
    assert len(backend.submitted) < 2 * 40


def test_chat_beams_and_stop_strings(args, tok) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    (r,), backend = _post(args, tok, [(CHAT, {"messages": msgs, "n": 3, "max_tokens": 5, "use_beam_search": True,
                                                "stop": ["e"], "return_token_ids": True})])
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 3 and [c["index"] for c in choices] == [0, 1, 2]
    for c in choices:
        assert "e" not in c["message"]["content"]
        assert c["finish_reason"] in ("stop", "length")
    prompt = backend.submitted[0].input_ids
    assert all(s.input_ids[: len(prompt)] == prompt for s in backend.submitted)


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_beams_come_whole_when_the_search_ends(args, tok, chat: bool) -> None:
    """As vLLM streams a beam search: one chunk per returned beam, with its whole text and finish."""
    base = ({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}) | {
        "n": 3, "max_tokens": 5, "use_beam_search": True, "return_token_ids": True}
    path = CHAT if chat else COMP
    (whole, streamed), _ = _post(args, tok, [(path, base), (path, {**base, "stream": True,
                                                                   "stream_options": {"include_usage": True}})])
    assert whole.status_code == 200 and streamed.status_code == 200, streamed.text
    events = sse_events(streamed.text)
    chunks = [e for e in events if e["choices"]]
    assert events[-1]["usage"] == whole.json()["usage"]
    got = {c["choices"][0]["index"]: c["choices"][0] for c in chunks}
    for c in whole.json()["choices"]:
        one = got[c["index"]]
        text = one["delta"].get("content") if chat else one["text"]
        assert text == (c["message"]["content"] if chat else c["text"])
        assert (one["finish_reason"], one["token_ids"]) == (c["finish_reason"], c["token_ids"])


@pytest.mark.parametrize(("body", "param"), [
    ({"n": 11}, "n"),
    ({"n": 2, "best_of": 3}, "best_of"),
    ({"echo": True}, "echo"),
    ({"top_p": 0.5}, "top_p"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_bad_beam_requests_are_400_naming_the_field(args, tok, body: dict, param: str) -> None:
    rs, backend = _post(args, tok, [(COMP, {"prompt": "a", "use_beam_search": True, **body}),
                                    (COMP, {"prompt": "a", "max_tokens": 1})])
    assert rs[0].status_code == 400 and rs[0].json()["error"]["param"] == param, rs[0].text
    assert rs[1].status_code == 200
    assert len(backend.submitted) == 1


def test_length_penalty_without_beam_search_is_400(args, tok) -> None:
    rs, _ = _post(args, tok, [(COMP, {"prompt": "a", "length_penalty": 2.0}),
                              (COMP, {"prompt": "a", "max_tokens": 1, "length_penalty": 1.0, "best_of": 2, "n": 2,
                                      "use_beam_search": True})])
    assert rs[0].status_code == 400 and rs[0].json()["error"]["param"] == "length_penalty"
    assert rs[1].status_code == 200 and len(rs[1].json()["choices"]) == 2


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_aborts_the_outstanding_step_requests(args, tok, stream: bool) -> None:
    backend = ToyBackend(gate=asyncio.Event())
    app = create_app(args, backend, tok)  # type: ignore[arg-type]
    conn = FakeConnection({"prompt": "ab", "n": 3, "max_tokens": 4, "use_beam_search": True, "stream": stream})

    async def main() -> None:
        call = asyncio.ensure_future(app(_scope(COMP), conn.receive, conn.send))
        while not backend.open_streams:
            await asyncio.sleep(0)
        conn.gone.set()
        await asyncio.wait_for(call, 10)

    asyncio.run(main())
    ctx = app.state.ctx
    ctx.check_integrity()
    assert len(ctx.in_flight) == 0
    assert backend.submitted and {rid for rid, _ in backend.aborted} == {s.rid for s in backend.submitted}
    backend.check_integrity()


def test_a_step_request_aborted_by_the_server_ends_the_search_with_503(args, tok) -> None:
    backend = ToyBackend()
    backend.abort_suffix = "-beam1.0"
    rs, _ = _post(args, tok, [(COMP, {"prompt": "ab", "n": 2, "max_tokens": 5, "use_beam_search": True}),
                              (COMP, {"prompt": "ab", "max_tokens": 1})], backend)
    assert rs[0].status_code == 503 and rs[1].status_code == 200, rs[0].text
    assert not any("-beam2." in s.rid for s in backend.submitted)  # no step after the failed one
