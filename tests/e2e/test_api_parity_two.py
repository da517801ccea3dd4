"""API parity with vLLM's and SGLang's servers, round two, each as the peer's client sends it, through a real
launch.py (context length 64): the Responses API (tool_choice "auto"/"none" without tools, usage's chat-named
counts, malformed vs unknown response ids), vLLM's `prompt_logprobs` where its clients read it, /tokenize and
/detokenize in vLLM's shapes (SGLang's at /v1/detokenize), vLLM's /load and /invocations, the context
refusals in each peer's wording, and a seed out of range refused with its range."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlparse

import httpx
import openai
import pytest

from tests.e2e.server import Server, running_server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

MODEL = "hyssm-tiny"
CONTEXT = 64
MAX_SEED = (1 << 63) - 1


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with running_server(["--random-seed", "0", "--context-length", str(CONTEXT)]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _error(exc: openai.APIStatusError) -> dict:
    body = exc.body
    assert isinstance(body, dict)
    return body.get("error", body)  # the SDK hands over the body's `error` object


# ---------------------------------------------------------------- Responses API
@pytest.mark.parametrize("choice", ["auto", "none"])
def test_responses_tool_choice_without_tools_and_usage_aliases(client: openai.OpenAI, choice: str) -> None:
    r = client.responses.create(model=MODEL, input="Say hi.", tool_choice=choice, max_output_tokens=4,  # type: ignore[arg-type]
                                temperature=0)  # fmt: skip
    assert r.status in ("completed", "incomplete") and r.tool_choice == choice
    usage = r.usage
    assert usage is not None and usage.input_tokens > 0 and 0 < usage.output_tokens <= 4
    extra = usage.model_extra or {}
    assert extra["prompt_tokens"] == usage.input_tokens and extra["completion_tokens"] == usage.output_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


def test_responses_tool_choice_required_without_tools_is_still_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="hi", tool_choice="required", max_output_tokens=2)
    assert _error(e.value)["param"] == "tool_choice"


def test_malformed_response_ids_are_400s_and_unknown_ones_404s(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model=MODEL, input="hi", previous_response_id="gen-123", max_output_tokens=2)
    err = _error(bad.value)
    assert err["param"] == "previous_response_id" and "Expected an ID that begins with 'resp'" in err["message"]
    with pytest.raises(openai.NotFoundError) as unknown:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_" + "0" * 32,
                                max_output_tokens=2)  # fmt: skip
    assert _error(unknown.value)["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as bad_get:
        client.responses.retrieve("msg_123")
    assert _error(bad_get.value)["param"] == "response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")
    kept = client.responses.create(model=MODEL, input="hi", max_output_tokens=2)  # the server still serves
    assert client.responses.retrieve(kept.id).id == kept.id


# ---------------------------------------------------------------- prompt_logprobs
def _check_prompt_logprobs(plp: list, ids: list[int], k: int) -> None:
    """vLLM's shape: None first, then per position the prompt token (its id as a string) and the k most likely
    (ranks 1..k); the prompt token among them is one entry, else one more with its own rank."""
    assert plp[0] is None and len(plp) == len(ids)
    for entry, t in zip(plp[1:], ids[1:], strict=True):
        mine = entry[str(t)]
        assert isinstance(mine["decoded_token"], str) and (t >= 128 or mine["decoded_token"] == chr(t))
        for e in entry.values():
            assert set(e) == {"logprob", "rank", "decoded_token"} and e["logprob"] <= 0.0
        assert set(range(1, k + 1)) <= {e["rank"] for e in entry.values()}
        assert len(entry) == (k if mine["rank"] <= k else k + 1)


def test_prompt_logprobs_on_completion_choices_and_the_chat_completion(client: openai.OpenAI) -> None:
    prompts = [list(b"A robot may not"), list(b"My name is")]
    comp = client.completions.create(model=MODEL, prompt=prompts, max_tokens=2, temperature=0,
                                     extra_body={"prompt_logprobs": 1})  # fmt: skip
    for choice in comp.choices:
        _check_prompt_logprobs(choice.prompt_logprobs, prompts[choice.index], 1)  # type: ignore[attr-defined]
    plain = client.completions.create(model=MODEL, prompt=prompts, max_tokens=2, temperature=0)
    assert all(c.prompt_logprobs is None for c in plain.choices)  # type: ignore[attr-defined]

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where was it played?"}]
    one = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,  # type: ignore[arg-type]
                                         extra_body={"prompt_logprobs": 1, "return_token_ids": True})  # fmt: skip
    two = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,  # type: ignore[arg-type]
                                         extra_body={"prompt_logprobs": 2, "return_token_ids": True})  # fmt: skip
    ids = one.prompt_token_ids  # type: ignore[attr-defined]
    assert len(ids) == one.usage.prompt_tokens  # type: ignore[union-attr]
    _check_prompt_logprobs(one.prompt_logprobs, ids, 1)  # type: ignore[attr-defined]
    _check_prompt_logprobs(two.prompt_logprobs, ids, 2)  # type: ignore[attr-defined]
    assert all(len(b) >= len(a) for a, b in zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:], strict=True))  # type: ignore[attr-defined]
    plain_chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)  # type: ignore[arg-type]
    assert plain_chat.prompt_logprobs is None  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=messages, extra_body={"prompt_logprobs": -1})  # type: ignore[arg-type]


# ---------------------------------------------------------------- /tokenize, /detokenize
def test_tokenize_and_detokenize_in_vllms_shapes(server: Server) -> None:
    prompt = "This is a token_strs test"
    with server.client() as c:
        plain = c.post("/tokenize", json={"model": MODEL, "prompt": prompt}).json()
        assert plain == {"tokens": plain["tokens"], "count": len(plain["tokens"]), "max_model_len": CONTEXT,
                         "token_strs": None}  # fmt: skip
        strs = c.post("/tokenize", json={"model": MODEL, "prompt": prompt, "return_token_strs": True}).json()
        assert strs["tokens"] == plain["tokens"] and len(strs["token_strs"]) == strs["count"]
        assert all(isinstance(s, str) for s in strs["token_strs"])
        ids = c.post("/tokenize", json={"prompt": prompt, "add_special_tokens": False}).json()["tokens"]
        assert c.post("/detokenize", json={"model": MODEL, "tokens": ids}).json() == {"prompt": prompt}
        assert c.post("/v1/detokenize", json={"tokens": ids}).json() == {"text": prompt}  # SGLang's
        assert c.post("/v1/tokenize", json={"prompt": prompt}).json() == plain


# ---------------------------------------------------------------- /load, /invocations
def _load(c: httpx.Client) -> int:
    r = c.get("/load")
    assert r.status_code == 200 and set(r.json()) == {"server_load"}, r.text
    return r.json()["server_load"]


def test_load_counts_a_request_until_its_answer_is_sent(server: Server) -> None:
    """A completion whose body is still arriving is in flight; once its whole answer has been read it is not."""
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2}).encode()
    url = urlparse(server.url)
    with server.client() as c, socket.create_connection((url.hostname, url.port), timeout=60) as raw:
        assert _load(c) == 0
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                    b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:5])  # fmt: skip
        deadline = time.monotonic() + 30  # the server reads the headers on its own loop: wait until it counts them
        while (load := _load(c)) == 0 and time.monotonic() < deadline:
            pass
        assert load == 1
        raw.sendall(body[5:])
        answer = b""
        while chunk := raw.recv(65536):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 200") and b"text_completion" in answer
        assert _load(c) == 0  # dropped before the last byte of the answer went out
        with c.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3,
                                                       "stream": True}) as s:  # fmt: skip
            assert s.status_code == 200 and "[DONE]" in s.read().decode()
        assert _load(c) == 0


def test_invocations_dispatches_on_the_body_shape(server: Server) -> None:
    with server.client() as c:
        chat = c.post("/invocations", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                            "max_tokens": 2})  # fmt: skip
        assert chat.status_code == 200 and chat.json()["object"] == "chat.completion", chat.text
        comp = c.post("/invocations", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert comp.status_code == 200 and comp.json()["object"] == "text_completion", comp.text
        streamed = c.post("/invocations", json={"prompt": "hi", "max_tokens": 2, "stream": True})
        assert streamed.text.rstrip().endswith("data: [DONE]")
        embed = c.post("/invocations", json={"model": MODEL, "input": "hi"})
        assert embed.status_code == 400 and "chat completions" in embed.json()["error"]["message"], embed.text
        assert "embeddings" in embed.json()["error"]["message"]
        bad = c.post("/invocations", json={"messages": "nope"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages", bad.text
        assert c.post("/invocations", content=b"[1, 2]").status_code == 400
        assert _load(c) == 0


# ---------------------------------------------------------------- context refusals, seed
def test_context_refusals_in_vllms_wording_on_the_openai_routes(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as long_prompt:
        client.completions.create(model=MODEL, prompt=[list(b"x" * (CONTEXT + 6))], max_tokens=1)
    err = _error(long_prompt.value)
    assert err["param"] == "prompt"
    assert err["message"].startswith(f"This model's maximum context length is {CONTEXT} tokens. However, your "
                                     f"request has {CONTEXT + 6} input tokens.")  # fmt: skip
    assert "is longer than the model's context length" in err["message"]
    with pytest.raises(openai.BadRequestError) as past:
        client.completions.create(model=MODEL, prompt=[list(b"x" * 10)], max_tokens=60)
    err = _error(past.value)
    assert err["param"] == "max_tokens" and err["message"] == (
        f"This model's maximum context length is {CONTEXT} tokens. However, you requested 70 tokens (10 in the "
        "messages, 60 in the completion). Please reduce the length of the messages or completion.")
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_completion_tokens=CONTEXT)  # fmt: skip
    assert "Please reduce the length of the messages or completion." in _error(chat.value)["message"]
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=1).choices  # still serving


def test_context_refusals_in_sglangs_wording_on_generate(server: Server) -> None:
    with server.client() as c:
        long_ids = list(b"x" * (CONTEXT + 6))
        r = c.post("/generate", json={"input_ids": long_ids, "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 400 and r.json()["error"]["message"] == (
            f"The input ({CONTEXT + 6} tokens) is longer than the model's context length ({CONTEXT} tokens).")
        r = c.post("/generate", json={"input_ids": list(b"x" * 10), "sampling_params": {"max_new_tokens": 60}})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "sampling_params.max_new_tokens"
        assert err["message"] == (
            f"Requested token count exceeds the model's maximum context length of {CONTEXT} tokens. You requested "
            "a total of 70 tokens: 10 tokens from the input messages and 60 tokens for the completion. Please "
            "reduce the number of tokens in the input messages or the completion to fit within the limit.")


@pytest.mark.parametrize("seed", [-1, MAX_SEED + 1, 1 << 64, 10**30])
def test_a_seed_out_of_range_is_refused_with_its_range(client: openai.OpenAI, seed: int) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1, seed=seed)
    err = _error(e.value)
    assert err["param"] == "seed" and err["message"] == (
        f"seed must be an integer in [0, {MAX_SEED}] (a non-negative signed 64-bit integer), got {seed}")


def test_a_seed_too_large_to_decode_and_generates_seeds(server: Server, client: openai.OpenAI) -> None:
    with server.client() as c:
        huge = c.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": 1, "seed": ' + b"9" * 5000 + b"}",
                      headers={"content-type": "application/json"})  # fmt: skip
        err = huge.json()["error"]
        assert huge.status_code == 400 and err["param"] == "seed" and f"[0, {MAX_SEED}]" in err["message"]
        native = c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1, "seed": 1 << 70}})
        assert native.status_code == 400 and native.json()["error"]["param"] == "sampling_params.seed"
        assert f"[0, {MAX_SEED}]" in native.json()["error"]["message"]
    ok = client.completions.create(model=MODEL, prompt="hi", max_tokens=1, seed=MAX_SEED)
    assert ok.choices[0].finish_reason in ("stop", "length")
