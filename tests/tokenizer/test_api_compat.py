"""What real clients send beyond the basics, against a fake backend: harmless fields (accepted) and
unknown ones (a 400 naming them), model names, /v1/models/{id}, /tokenize and /detokenize, n > 1 and
batches of prompts (indexes, seeds, usage, streaming), echo with prompt logprobs, top logprobs,
streamed text_offset."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.tokenizer.conftest import EOS, FakeBackend
from tests.tokenizer.test_app import serve

COMP, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]


def _events(text: str) -> list[dict[str, Any]]:
    lines = [ln[len("data: "):] for ln in text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_harmless_fields_are_accepted_and_unknown_ones_are_400_naming_them(args, backend, tok) -> None:
    harmless = {"metadata": {"k": "v"}, "store": False, "service_tier": "auto", "user": "u",
                "reasoning_effort": "low", "prediction": {"type": "content", "content": "x"},
                "modalities": ["text"], "parallel_tool_calls": True, "tool_choice": "none",
                "response_format": {"type": "text"}}

    async def check(c: httpx.AsyncClient) -> None:
        r = await c.post(CHAT, json={"messages": MSGS, "max_tokens": 2, **harmless})
        assert r.status_code == 200, r.text
        for path, body, param in (
            (CHAT, {"messages": MSGS, "max_tokens": 2, **harmless, "frobnicate": 1}, "frobnicate"),
            (CHAT, {"messages": MSGS, "stream": True, "stream_options": {"include_usage": True, "x": 1}},
             "stream_options.x"),
            ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 1, "warp": 9}}, "sampling_params.warp"),
            ("/generate", {"text": ["a", "b"], "sampling_params": [{}, {"warp": 9}]}, "sampling_params[1].warp"),
        ):
            r = await c.post(path, json=body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == param and err["message"] == f"Unrecognized request argument supplied: {param}"

    serve(args, backend, tok, check)
    assert len(backend.submitted) == 1


@pytest.mark.parametrize(("path", "body", "param", "text"), [
    (CHAT, {"messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "schema"),
    (CHAT, {"messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
     "response_format.json_schema.schema", "Type should be a string"),
    (CHAT, {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "'g'"),
    (CHAT, {"messages": MSGS, "tool_choice": "required"}, "tool_choice", "needs tools"),
    (CHAT, {"messages": MSGS, "tools": [{"function": {"name": "f"}}, {"function": {"name": "f"}}]}, "tools",
     "distinct"),
    (CHAT, {"messages": MSGS, "tools": [{"function": {"name": "f", "parameters": {"type": "nope"}}}],
            "tool_choice": "required"}, "tools", "not usable"),
    (COMP, {"prompt": "a", "guided_regex": "a("}, "guided_regex", "parenthesis"),
    (COMP, {"prompt": "a", "guided_json": "{not json"}, "guided_json", "JSON"),
    (COMP, {"prompt": "a", "guided_choice": []}, "guided_choice", "non-empty"),
    (COMP, {"prompt": "a", "guided_grammar": "root ::= y"}, "guided_grammar", "not defined"),
    (COMP, {"prompt": "a", "guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
     "one output constraint"),
    ("/generate", {"text": "a", "sampling_params": {"regex": "[a-"}}, "sampling_params.regex", "regex"),
    ("/generate", {"text": "a", "sampling_params": {"ebnf": "root ::= x"}}, "sampling_params.ebnf", "not defined"),
    ("/generate", {"text": "a", "sampling_params": {"json_schema": "[1"}}, "sampling_params.json_schema", "JSON"),
    ("/generate", {"text": "a", "sampling_params": {"regex": "a", "ebnf": "root ::= \"a\""}},
     "sampling_params.ebnf", "one of"),
    # constraints no text satisfies: empty from the start, or after the text they force
    (COMP, {"prompt": "a", "guided_regex": r"[^\s\S]"}, "guided_regex", "regex is not usable: no text satisfies it"),
    (CHAT, {"messages": MSGS, "structured_outputs": {"regex": r"ab[^\s\S]"}}, "structured_outputs.regex",
     "no text satisfies it (nothing can follow 'ab')"),
    (CHAT, {"messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": r"[^\s\S]"}}, "required": ["s"]}}}},
     "response_format.json_schema.schema", "no text satisfies it (nothing can follow '{\"s\": \"')"),
    ("/generate", {"text": "a", "sampling_params": {"ebnf": 'root ::= r\nr ::= r "a"'}}, "sampling_params.ebnf",
     "no text satisfies it"),
])
def test_fields_that_change_results_are_400_naming_them(args, backend, tok, path, body, param, text) -> None:
    async def check(c: httpx.AsyncClient) -> None:
        r = await c.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert text in r.json()["error"]["message"]

    serve(args, backend, tok, check)
    assert backend.submitted == []


@pytest.mark.parametrize("body", [
    {"guided_regex": "é+|日本|😀"},  # several bytes per character
    {"guided_regex": ""},  # only the empty text
    {"guided_regex": "[^a-z]+"},
    {"regex": r"(a|b)[^\s\S]"},  # empty, but only after a choice: found at run time, not here
    {"guided_grammar": 'root ::= "a" root'},  # forced on and on: the check stops following it
    {"guided_json": {"type": "object", "properties": {"s": {"type": "string", "pattern": r"[^\s\S]"}}}},  # optional
    {"response_format": {"type": "json_object"}},
])
def test_constraints_some_text_may_satisfy_are_accepted(args, backend, tok, body) -> None:
    async def check(c: httpx.AsyncClient) -> None:
        r = await c.post(COMP, json={"prompt": "a", "max_tokens": 2, **body})
        assert r.status_code == 200, r.text

    serve(args, backend, tok, check)
    assert len(backend.submitted) == 1 and backend.submitted[0].sampling.grammar is not None


def test_model_names(args, backend, tok) -> None:
    async def check(c: httpx.AsyncClient) -> None:
        r = await c.get(f"/v1/models/{args.model_name}")
        assert r.status_code == 200 and r.json()["id"] == args.model_name and r.json()["object"] == "model"
        r = await c.get("/v1/models/other-model")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        assert "other-model" in r.json()["error"]["message"]
        r = await c.post(COMP, json={"model": "other-model", "prompt": "a"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        for name in (args.model_name, args.model_path):
            r = await c.post(COMP, json={"model": name, "prompt": "a", "max_tokens": 1})
            assert r.status_code == 200, r.text

    serve(args, backend, tok, check)


def test_tokenize_and_detokenize(args, backend, tok) -> None:
    async def check(c: httpx.AsyncClient) -> None:
        r = (await c.post("/tokenize", json={"prompt": "hey", "return_token_strs": True})).json()
        assert r["tokens"] == tok.encode("hey") and r["count"] == len(r["tokens"])
        assert r["max_model_len"] > 0 and "".join(r["token_strs"]).endswith("hey")
        r = (await c.post("/tokenize", json={"prompt": ["a", "bc"], "add_special_tokens": False})).json()
        assert r["tokens"] == [[ord("a")], [ord("b"), ord("c")]] and r["count"] == [1, 2]
        r = (await c.post("/tokenize", json={"messages": MSGS})).json()
        assert r["tokens"] == tok.encode(tok.render_chat(MSGS), add_special_tokens=False)
        r = (await c.post("/detokenize", json={"tokens": [ord("o"), ord("k")]})).json()
        assert r == {"prompt": "ok"}  # vLLM's answer, whole
        r = (await c.post("/v1/detokenize", json={"tokens": [ord("o"), ord("k")]})).json()
        assert r == {"text": "ok"}  # SGLang's path and answer
        r = (await c.post("/tokenize", json={"prompt": "ok"})).json()
        assert r["token_strs"] is None  # present and null unless asked, as vLLM answers
        assert (await c.post("/v1/tokenize", json={"prompt": "ok"})).json() == r
        r = await c.post("/detokenize", json={"tokens": [10**6]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
        r = await c.post("/tokenize", json={})
        assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]

    serve(args, backend, tok, check)


def test_n_and_prompt_batches(args, backend, tok) -> None:
    async def check(c: httpx.AsyncClient) -> None:
        r = (await c.post(COMP, json={"prompt": ["ab", [ord("x"), ord("y"), ord("z")]], "n": 2, "max_tokens": 3,
                                      "seed": 10})).json()
        assert [ch["index"] for ch in r["choices"]] == [0, 1, 2, 3]
        assert all(ch["text"] == "hel" for ch in r["choices"])
        assert r["usage"]["prompt_tokens"] == len(tok.encode("ab")) + 3  # each prompt once
        assert r["usage"]["completion_tokens"] == 12
        assert not r["id"].endswith(("-0", "-1", "-2", "-3"))
        r = (await c.post(CHAT, json={"messages": MSGS, "n": 3, "max_tokens": 2})).json()
        assert [ch["index"] for ch in r["choices"]] == [0, 1, 2]
        assert all(ch["message"]["content"] == "he" for ch in r["choices"])

    serve(args, backend, tok, check)
    comp = sorted(backend.submitted[:4], key=lambda s: int(s.rid.rsplit("-", 1)[1]))
    assert [s.sampling.seed for s in comp] == [10, 11, 10, 11]  # choice i: seed + i, per prompt
    assert comp[0].input_ids == comp[1].input_ids == tok.encode("ab")
    assert comp[2].input_ids == [ord("x"), ord("y"), ord("z")]
    # the first choice of each prompt saves the prompt's state and is submitted before its siblings
    assert [s.save_prompt_state for s in comp] == [True, False, True, False]
    order = [s.rid for s in backend.submitted[:4]]
    assert order.index(comp[0].rid) < order.index(comp[1].rid) and order.index(comp[2].rid) < order.index(comp[3].rid)
    assert len({s.rid for s in backend.submitted}) == 7
    assert len({s.sampling.seed for s in backend.submitted[4:]}) == 1  # no seed: the rids differ instead


def test_streamed_choices_and_usage(args, backend, tok) -> None:
    async def check(c: httpx.AsyncClient) -> None:
        r = await c.post(CHAT, json={"messages": MSGS, "n": 2, "max_tokens": 4, "stream": True,
                                     "stream_options": {"include_usage": True}})
        events = _events(r.text)
        by_index: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
        for e in events[:-1]:
            (ch,) = e["choices"]
            by_index[ch["index"]].append(ch)
        for chunks in by_index.values():
            assert chunks[0]["delta"]["role"] == "assistant"
            assert "".join(ch["delta"].get("content", "") for ch in chunks) == "hell"
            assert [ch["finish_reason"] for ch in chunks][-1] == "length"
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 8

    serve(args, backend, tok, check)


def test_echo_with_prompt_logprobs_and_top_logprobs(args, backend, tok) -> None:
    prompt = [ord("a"), ord("b"), ord("c")]

    async def check(c: httpx.AsyncClient) -> None:
        # the shape lm-eval's loglikelihood sends
        r = (await c.post(COMP, json={"prompt": [prompt], "max_tokens": 1, "logprobs": 1, "echo": True})).json()
        (ch,) = r["choices"]
        lp = ch["logprobs"]
        assert ch["text"] == "abch"
        assert lp["tokens"] == ["a", "b", "c", "h"]
        assert lp["token_logprobs"] == [None, -1.0, -1.0, -0.5]
        assert lp["top_logprobs"] == [None, {"b": -1.0}, {"c": -1.0}, {"h": -0.5}]
        assert lp["text_offset"] == [0, 1, 2, 3]
        r = (await c.post(CHAT, json={"messages": MSGS, "max_tokens": 2, "logprobs": True,
                                      "top_logprobs": 2})).json()
        content = r["choices"][0]["logprobs"]["content"]
        assert [x["token"] for x in content] == ["h", "e"]
        assert [[t["token"] for t in x["top_logprobs"]] for x in content] == [["h", tok.token_text(EOS)],
                                                                             ["e", tok.token_text(EOS)]]

    serve(args, backend, tok, check)
    assert backend.submitted[0].sampling.prompt_logprobs == 1 and backend.submitted[0].sampling.top_logprobs == 1
    assert backend.submitted[1].sampling.prompt_logprobs == -1 and backend.submitted[1].sampling.top_logprobs == 2


def test_streamed_text_offset_continues(args, tok) -> None:
    backend = FakeBackend(plan=lambda req: [[ord(ch)] for ch in "hello"])

    async def check(c: httpx.AsyncClient) -> None:
        r = await c.post(COMP, json={"prompt": "xy", "max_tokens": 5, "logprobs": 0, "stream": True, "echo": True})
        events = _events(r.text)
        offsets = [o for e in events for o in e["choices"][0]["logprobs"]["text_offset"]]
        text = "".join(e["choices"][0]["text"] for e in events)
        tokens = [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]]
        assert text == "xyhello"
        assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        assert tokens[-5:] == list("hello") and offsets[-5:] == [2, 3, 4, 5, 6]

    serve(args, backend, tok, check)


def _sample(text: str, name: str) -> float:
    line = next(ln for ln in text.splitlines() if ln.startswith(name + " "))
    return float(line.split()[-1])


def test_latency_histograms(args, backend, tok) -> None:
    async def check(c: httpx.AsyncClient) -> None:
        for stream in (False, True):
            r = await c.post(COMP, json={"prompt": "ab", "max_tokens": 3, "stream": stream})
            assert r.status_code == 200
        r = await c.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 200
        text = (await c.get("/metrics")).text
        assert _sample(text, "hyssm_time_to_first_token_seconds_count") == 3
        assert _sample(text, "hyssm_inter_token_latency_seconds_count") == 4  # 2 gaps in each 3-token request
        assert _sample(text, "hyssm_time_per_output_token_seconds_count") == 2  # 1-token requests have no TPOT
        assert _sample(text, "hyssm_e2e_request_latency_seconds_count") == 3
        assert _sample(text, 'hyssm_e2e_request_latency_seconds_bucket{le="+Inf"}') == 3
        e2e, ttft = (_sample(text, f"hyssm_{n}_sum") for n in ("e2e_request_latency_seconds",
                                                              "time_to_first_token_seconds"))
        assert e2e >= ttft > 0

    serve(args, backend, tok, check)


def test_histogram_buckets() -> None:
    from tokenizer_proc.requests.latency import Histogram

    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    h.observe(0.7, 2)
    fam = h.family("x_seconds", "doc")
    got = {s.labels.get("le"): s.value for s in fam.samples if s.name == "x_seconds_bucket"}
    assert got == {"0.1": 2, "1.0": 5, "+Inf": 6} and h.n == 6 and h.total == pytest.approx(5.05)


def test_native_logprobs(args, backend, tok) -> None:
    async def check(c: httpx.AsyncClient) -> None:
        r = (await c.post("/generate", json={"input_ids": [5, 6, 7], "return_logprob": True, "top_logprobs_num": 2,
                                             "logprob_start_len": 1, "sampling_params": {"max_new_tokens": 2}})).json()
        meta = r["meta_info"]
        assert meta["output_token_logprobs"] == [[-0.5, ord("h"), None], [-0.5, ord("e"), None]]
        assert meta["output_top_logprobs"] == [[[-0.5, ord("h"), None], [-2.0, EOS, None]],
                                               [[-0.5, ord("e"), None], [-2.0, EOS, None]]]
        assert meta["input_token_logprobs"] == [[-1.0, 6, None], [-1.0, 7, None]]  # from position 1

    serve(args, backend, tok, check)
    assert backend.submitted[0].sampling.prompt_logprobs == 2 and backend.submitted[0].sampling.top_logprobs == 2


def test_chat_template_kwargs_reach_the_template() -> None:
    from tokenizer_proc.requests.chat_template import ChatTemplate

    t = ChatTemplate("{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}{{ tools | length }}")
    assert t.render([{"role": "user", "content": "x"}], extra={"greeting": "hi ", "messages": "ignored"},
                    tools=[{"a": 1}]) == "hi x1"


def test_echo_with_zero_max_tokens_scores_the_prompt_only(args, backend, tok) -> None:
    async def check(c: httpx.AsyncClient) -> None:
        for stream in (False, True):
            body = {"prompt": "abc", "max_tokens": 0, "echo": True, "logprobs": 1, "stream": stream,
                    "stream_options": {"include_usage": True} if stream else None}
            r = await c.post(COMP, json={k: v for k, v in body.items() if v is not None})
            assert r.status_code == 200, r.text
            if stream:
                events = _events(r.text)
                choices = [e["choices"][0] for e in events if e["choices"]]
                text = "".join(ch["text"] for ch in choices)
                tokens = [t for ch in choices for t in ch["logprobs"]["tokens"]]
                usage, finish = events[-1]["usage"], choices[-1]["finish_reason"]
            else:
                ch = r.json()["choices"][0]
                text, tokens, finish = ch["text"], ch["logprobs"]["tokens"], ch["finish_reason"]
                usage = r.json()["usage"]
            assert text == "abc" and tokens == ["a", "b", "c"] and finish == "length"
            assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] == 3
        r = await c.post(COMP, json={"prompt": "abc", "max_tokens": 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"

    serve(args, backend, tok, check)


def test_best_of_returns_the_most_likely(args, tok) -> None:
    def plan(req):  # choice k: 3 - k tokens of logprob -0.5 each, so the last choice is the most likely
        k = int(req.rid.rsplit("-", 1)[1]) % 3
        return [[ord("a") + k]] * (3 - k)

    backend = FakeBackend(plan=plan)

    async def check(c: httpx.AsyncClient) -> None:
        r = (await c.post(COMP, json={"prompt": ["p", "q"], "max_tokens": 3, "best_of": 3, "n": 1})).json()
        assert [(ch["index"], ch["text"]) for ch in r["choices"]] == [(0, "c"), (1, "c")]
        assert r["choices"][0]["logprobs"] is None  # not asked for, though used for the ranking
        assert r["usage"]["completion_tokens"] == 2 * (3 + 2 + 1)
        r = (await c.post(COMP, json={"prompt": "p", "max_tokens": 3, "best_of": 3, "n": 2, "logprobs": 0})).json()
        assert [(ch["index"], ch["text"]) for ch in r["choices"]] == [(0, "c"), (1, "bb")]
        assert r["choices"][1]["logprobs"]["token_logprobs"] == [-0.5, -0.5]

    serve(args, backend, tok, check)
    assert all(s.sampling.logprobs for s in backend.submitted) and len(backend.submitted) == 9


def test_native_batches_and_n(args, backend, tok) -> None:
    async def check(c: httpx.AsyncClient) -> None:
        r = await c.post("/generate", json={"text": ["a", "bb"], "rid": "job",
                                            "sampling_params": {"max_new_tokens": 2, "n": 2, "seed": 4}})
        out = r.json()
        assert r.status_code == 200 and isinstance(out, list) and len(out) == 4
        assert [o["meta_info"]["id"] for o in out] == ["job-0", "job-1", "job-2", "job-3"]
        assert all(o["text"] == "he" for o in out)
        assert [o["meta_info"]["prompt_tokens"] for o in out] == [1, 1, 2, 2]
        r = await c.post("/generate", json={"input_ids": [[5, 6], [7]], "stream": True,
                                            "sampling_params": {"max_new_tokens": 3}})
        events = _events(r.text)
        last = {e["index"]: e for e in events}
        assert sorted(last) == [0, 1] and all(e["text"] == "hel" for e in last.values())
        single = (await c.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 1}})).json()
        assert isinstance(single, dict)  # one prompt, n = 1: the single-object answer

    serve(args, backend, tok, check)
    seeds = {s.rid: s.sampling.seed for s in backend.submitted[:4]}
    assert seeds == {"job-0": 4, "job-1": 5, "job-2": 4, "job-3": 5}


def test_native_batch_with_sampling_params_per_prompt(args, backend, tok) -> None:
    async def check(c: httpx.AsyncClient) -> None:
        per = [{"max_new_tokens": 1, "n": 2, "seed": 1}, {"max_new_tokens": 3}, {"max_new_tokens": 2, "regex": "x+"}]
        r = await c.post("/generate", json={"text": ["a", "bb", "c"], "rid": "per", "sampling_params": per})
        out = r.json()
        assert r.status_code == 200 and [o["meta_info"]["id"] for o in out] == [f"per-{i}" for i in range(4)]
        assert [o["text"] for o in out] == ["h", "h", "hel", "he"]
        one = (await c.post("/generate", json={"text": "a", "sampling_params": [{"max_new_tokens": 2}]})).json()
        assert isinstance(one, list) and one[0]["text"] == "he"
        for body, param in (({"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 1}]}, "sampling_params"),
                            ({"text": ["a"], "sampling_params": [{"n": 0}]}, "sampling_params[0].n"),
                            ({"text": ["a"], "sampling_params": [5]}, "sampling_params")):  # fmt: skip
            bad = await c.post("/generate", json=body)
            assert bad.status_code == 400 and bad.json()["error"]["param"].startswith(param), bad.text

    serve(args, backend, tok, check)
    got = sorted((s.rid, s.sampling.max_new_tokens, s.sampling.seed, s.sampling.grammar is not None)
                 for s in backend.submitted[:4])  # fmt: skip
    assert got == [("per-0", 1, 1, False), ("per-1", 1, 2, False), ("per-2", 3, None, False), ("per-3", 2, None, True)]
