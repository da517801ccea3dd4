"""The API as real clients use it, through a real launch.py: the openai SDK (n, top logprobs, echo,
streamed text_offset, batches of prompts, /v1/models/{id}), lm-eval's loglikelihood request shape
(prompt logprobs equal the model's own, across prefill chunks and after a cache hit), and the
sampling controls (logit_bias, min_tokens, penalties) as they change real outputs."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from tests.e2e.server import Server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

MODEL = "hyssm-tiny"
EOS = 256


@pytest.fixture(scope="module")
def server(api_server: Server) -> Server:
    return api_server



def _reference_prompt_logprobs(runner, ids: list[int]) -> list[float]:
    import torch

    from shared.messages import ForwardBatch, ReqSlice

    sl = ReqSlice(rid="ref", input_ids=ids, start_pos=0, kv_slots=list(range(1, len(ids) + 1)), state_slot=1,
                  sample=True)
    from tests.model_driver import forward_all_logits

    logits = forward_all_logits(runner, ForwardBatch(step=0, reqs=[sl], clears=[1]))["ref"]
    logp = torch.log_softmax(logits.float(), dim=-1)
    return [logp[i, ids[i + 1]].item() for i in range(len(ids) - 1)]


def test_loglikelihood_request_shape(server: Server, reference_runner) -> None:
    ids = list(b"The quick brown fox jumps over the lazy dog")  # 43 tokens: six prefill chunks
    body = {"model": MODEL, "prompt": [ids], "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    want = _reference_prompt_logprobs(reference_runner, ids)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for _ in range(2):  # the second time the prompt is cached: its positions are still computed
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            lp = r.json()["choices"][0]["logprobs"]
            assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
            got = lp["token_logprobs"][1: len(ids)]
            assert all(math.isclose(g, w, abs_tol=2e-3) for g, w in zip(got, want, strict=True)), (got, want)
            assert lp["top_logprobs"][0] is None
            for tok_lp, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
                assert max(top.values()) >= tok_lp - 1e-6 and 1 <= len(top) <= 2
            assert lp["text_offset"] == list(range(len(ids) + 1))
        r = c.post("/v1/completions", json={**body, "max_tokens": 0})  # the legacy prompt-only form
        lp = r.json()["choices"][0]["logprobs"]
        assert lp["token_logprobs"][1:] == pytest.approx(want, abs=2e-3) and len(lp["tokens"]) == len(ids)


def test_openai_n_top_logprobs_and_batches(openai_client: openai.OpenAI) -> None:
    assert openai_client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        openai_client.models.retrieve("not-this-model")
    with pytest.raises(openai.NotFoundError):
        openai_client.completions.create(model="not-this-model", prompt="a", max_tokens=1)
    r = openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                       max_tokens=4, logprobs=True, top_logprobs=3, seed=5, temperature=1.0,
                                       metadata={"trace": "1"}, store=False, service_tier="auto")
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert c.logprobs is not None and len(c.logprobs.content) == r.usage.completion_tokens // 2
        for entry in c.logprobs.content:
            assert len(entry.top_logprobs) == 3
            assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6
    again = openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                           max_tokens=4, seed=5, temperature=1.0)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    best = openai_client.completions.create(model=MODEL, prompt="best", max_tokens=4, temperature=1.0, seed=2, n=2,
                                     best_of=4, logprobs=0)
    sums = [sum(c.logprobs.token_logprobs) for c in best.choices]
    assert [c.index for c in best.choices] == [0, 1] and sums[0] >= sums[1]
    assert best.usage.completion_tokens == 4 * 4
    b = openai_client.completions.create(model=MODEL, prompt=["one", "two", "three"], max_tokens=3, temperature=0)
    assert [c.index for c in b.choices] == [0, 1, 2]
    for i, p in enumerate(["one", "two", "three"]):
        alone = openai_client.completions.create(model=MODEL, prompt=p, max_tokens=3, temperature=0)
        assert b.choices[i].text == alone.choices[0].text


def test_openai_stream_text_offset_and_echo(openai_client: openai.OpenAI) -> None:
    whole = openai_client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0, logprobs=2,
                                      echo=True)
    lp = whole.choices[0].logprobs
    assert whole.choices[0].text.startswith("Hello") and lp.token_logprobs[0] is None
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    offsets, text = [], ""
    for chunk in openai_client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0, logprobs=2,
                                           echo=True, stream=True):
        if chunk.choices:
            text += chunk.choices[0].text
            offsets += chunk.choices[0].logprobs.text_offset
    assert text == whole.choices[0].text and offsets == lp.text_offset


def test_sampling_controls_change_outputs(openai_client: openai.OpenAI, server: Server) -> None:
    base = {"model": MODEL, "prompt": "abc", "max_tokens": 6, "temperature": 0}
    forced = openai_client.completions.create(**base, logit_bias={str(ord("z")): 100})
    assert forced.choices[0].text == "zzzzzz"
    # min_tokens holds EOS back even when it is forced
    r = openai_client.completions.create(**base, logit_bias={str(EOS): 100}, extra_body={"min_tokens": 3,
                                                                                   "skip_special_tokens": False})
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "stop"
    # a frequency penalty stops the biased token from repeating once its count outweighs the bias
    eight = {**base, "max_tokens": 8, "logit_bias": {str(ord("z")): 15}}
    plain = openai_client.completions.create(**eight)
    pen = openai_client.completions.create(**eight, frequency_penalty=2.0)
    assert plain.choices[0].text == "z" * 8 and pen.choices[0].text.count("z") < 8
    rep = openai_client.completions.create(**base, extra_body={"repetition_penalty": 5.0})
    again = openai_client.completions.create(**base, extra_body={"repetition_penalty": 5.0})
    assert rep.choices[0].text == again.choices[0].text  # deterministic
    with httpx.Client(base_url=server.url, timeout=30) as c:
        r = c.post("/v1/completions", json={**base, "presence_penalty": 9})
        assert r.status_code == 400 and r.json()["error"]["param"] == "presence_penalty"
        r = c.post("/tokenize", json={"prompt": "abc", "add_special_tokens": False})
        assert r.json()["tokens"] == list(b"abc")
        assert c.post("/detokenize", json={"tokens": list(b"abc")}).json() == {"prompt": "abc"}


def test_metrics_latency_histograms(openai_client: openai.OpenAI, server: Server) -> None:
    openai_client.completions.create(model=MODEL, prompt="metrics", max_tokens=4, temperature=0)
    text = httpx.get(server.url + "/metrics", timeout=30).text
    for name in ("time_to_first_token", "inter_token_latency", "time_per_output_token", "e2e_request_latency",
                 "queue_time"):
        count = next(ln for ln in text.splitlines() if ln.startswith(f"hyssm_{name}_seconds_count"))
        assert float(count.split()[-1]) >= 1, name
    # the same numbers under SGLang's names, labelled with the served model name
    def sample(line_start: str) -> float:
        return float(next(ln for ln in text.splitlines() if ln.startswith(line_start)).split()[-1])

    label = f'{{model_name="{MODEL}"}}'
    for sglang, hyssm in (("sglang:generation_tokens_total", "hyssm_generated_tokens_total"),
                          ("sglang:prompt_tokens_total", "hyssm_prefix_cache_queried_tokens_total"),
                          ("sglang:num_running_reqs", "hyssm_num_running_reqs"),
                          ("sglang:time_to_first_token_seconds_count", "hyssm_time_to_first_token_seconds_count"),
                          ("sglang:inter_token_latency_seconds_count", "hyssm_inter_token_latency_seconds_count"),
                          ("sglang:queue_time_seconds_count", "hyssm_queue_time_seconds_count")):
        assert sample(f"{sglang}{label} ") == sample(f"{hyssm} "), sglang
    assert sample(f"sglang:generation_tokens_total{label} ") >= 4
    assert 0 <= sample(f"sglang:token_usage{label} ") <= 1


def _prefill_tokens(server: Server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return float(next(ln for ln in text.splitlines() if ln.startswith("hyssm_prefill_tokens_total")).split()[-1])


@pytest.mark.parametrize("stream", [False, True])
def test_n_computes_the_prompt_once(openai_client: openai.OpenAI, server: Server, stream: bool) -> None:
    prompt = list(b"%d: n choices share one prefill of this prompt" % stream)  # nothing of it is cached yet
    before = _prefill_tokens(server)
    r = openai_client.completions.create(model=MODEL, prompt=prompt, n=4, max_tokens=3, temperature=1.0, seed=9,
                                  stream=stream)
    indexes = sorted({c.index for chunk in r for c in chunk.choices}) if stream else [c.index for c in r.choices]
    assert indexes == [0, 1, 2, 3]
    # the first choice computes the prompt (its last token is a one-token slice after the saved
    # state, which the prefill counter does not count); each other choice only that last token
    assert _prefill_tokens(server) - before == (len(prompt) - 1) + 3


def test_native_batch_and_n(server: Server) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        body = {"text": ["alpha", "beta"], "sampling_params": {"max_new_tokens": 3, "n": 2, "temperature": 0}}
        out = c.post("/generate", json=body).json()
        assert len(out) == 4 and all(o["meta_info"]["completion_tokens"] == 3 for o in out)
        for i, text in enumerate(["alpha", "alpha", "beta", "beta"]):
            alone = c.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 3,
                                                                                "temperature": 0}}).json()
            assert out[i]["output_ids"] == alone["output_ids"]  # greedy: every choice equals the prompt alone
