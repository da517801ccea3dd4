"""Beam search (`use_beam_search`) served end to end on the Bamba parity fixture in float32: the beams
(token ids, per-token logprobs, finish reasons, order) equal a plain beam search over transformers' model
written here (a full forward per step, log_softmax in float32, vLLM's length penalty) for beam widths 1, 2
and 4; every step after the first resumes from the state its parent's request left in the prefix cache
and computes one token; a server with two state slots serves a beam of width 4; bad requests are 400s
naming their field and the server keeps serving; the openai SDK gets the same beams streamed and not."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest
import torch

from shared.config import builtin_model_dir
from tests.e2e.server import DETERMINISTIC, Server, running_server
from tests.worker.util import fixture_dir

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

EOS = (2, 256)  # the model config's EOS and the tokenizer's
TOL = 1e-4
PROMPTS = [[106, 238, 203, 215, 80], [5, 17, 99, 42, 7]]  # the first ends two of its 4 best beams with EOS


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("bamba")
    for f in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(fixture_dir("bamba"), f), out / f)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(builtin_model_dir(), f), out / f)
    return str(out)


@pytest.fixture(scope="module")
def hf(model_path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def server(model_path: str) -> Iterator[Server]:
    with running_server(["--model-path", model_path, "--dtype", "float32", *DETERMINISTIC]) as srv:
        yield srv


def next_logprobs(model: torch.nn.Module, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    return torch.log_softmax(logits, dim=-1).tolist()


def reference(model: torch.nn.Module, prompt: list[int], width: int, max_tokens: int, penalty: float,
              ignore_eos: bool = False) -> list[dict]:  # fmt: skip
    """Plain beam search to max_tokens: each live beam's 2 x width most likely tokens; an EOS ends its
    beam (its logprob counted, the token not kept); the width best others live on; the answer is the
    width best by cum / (prompt + output) ** penalty."""
    live: list[tuple[list[int], list[float]]] = [([], [])]
    done: list[dict] = []
    for _ in range(max_tokens):
        grown = []
        for toks, lps in live:
            lp = next_logprobs(model, prompt + toks)
            for t in sorted(range(len(lp)), key=lambda t: (-lp[t], t))[: 2 * width]:
                if t in EOS and not ignore_eos:
                    done.append({"ids": toks, "lps": lps, "cum": sum(lps) + lp[t], "reason": "stop"})
                else:
                    grown.append((toks + [t], lps + [lp[t]]))
        grown.sort(key=lambda g: -sum(g[1]))
        live = grown[:width]
    done += [{"ids": t, "lps": lps, "cum": sum(lps), "reason": "length"} for t, lps in live]
    return sorted(done, key=lambda d: -d["cum"] / (len(prompt) + len(d["ids"])) ** penalty)[:width]


def beam_request(server: Server, prompt: list[int], width: int, max_tokens: int, penalty: float,
                 **extra: object) -> list[dict]:  # fmt: skip
    body = {"prompt": prompt, "n": width, "max_tokens": max_tokens, "use_beam_search": True,
            "length_penalty": penalty, "logprobs": 1, "return_token_ids": True, **extra}
    with server.client(timeout=300) as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"]


def assert_same(choices: list[dict], want: list[dict]) -> None:
    assert [c["token_ids"] for c in choices] == [w["ids"] for w in want]
    assert [c["finish_reason"] for c in choices] == [w["reason"] for w in want]
    for c, w in zip(choices, want, strict=True):
        got = c["logprobs"]["token_logprobs"]
        assert max((abs(a - b) for a, b in zip(got, w["lps"], strict=True)), default=0.0) <= TOL


@pytest.mark.parametrize(("width", "penalty"), [(1, 1.0), (2, 0.6), (4, 1.6), (4, 1.0)])
def test_beams_equal_a_plain_beam_search_over_transformers(server: Server, hf, width: int, penalty: float) -> None:
    reasons = []
    for prompt in PROMPTS:
        want = reference(hf, prompt, width, 7, penalty)
        assert_same(beam_request(server, prompt, width, 7, penalty), want)
        reasons += [w["reason"] for w in want]
    assert "stop" in reasons or (width, penalty) != (4, 1.0)  # beams ended by EOS are compared too


def test_each_step_resumes_from_its_parent_state(server: Server, hf) -> None:
    """With ignore_eos every step has `width` live beams: 1 + width x (steps - 1) requests, and the
    tokens computed are the prompt once plus one per further request."""
    prompt, width, steps = [9, 8, 7, 6, 5, 4, 3, 2, 11], 3, 6
    with server.client() as c:
        assert c.post("/flush_cache").status_code == 200
    queried = server.metric("hyssm_prefix_cache_queried_tokens_total")
    hit = server.metric("hyssm_prefix_cache_hit_tokens_total", kind="state")
    choices = beam_request(server, prompt, width, steps, 1.0, ignore_eos=True)
    assert_same(choices, reference(hf, prompt, width, steps, 1.0, ignore_eos=True))
    computed = (server.metric("hyssm_prefix_cache_queried_tokens_total") - queried
                - (server.metric("hyssm_prefix_cache_hit_tokens_total", kind="state") - hit))
    assert computed == len(prompt) + width * (steps - 1)


def test_bad_requests_are_400_and_the_server_keeps_serving(server: Server) -> None:
    base = {"prompt": [5, 6], "max_tokens": 3, "use_beam_search": True}
    bad = [({"echo": True}, "echo"), ({"n": 11}, "n"), ({"n": 2, "best_of": 4}, "best_of"),
           ({"top_p": 0.3}, "top_p")]
    with server.client() as c:
        for extra, param in bad:
            r = c.post("/v1/completions", json={**base, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "n": 2,
                                                     "max_tokens": 3, "use_beam_search": True})
    assert chat.status_code == 200 and len(chat.json()["choices"]) == 2, chat.text


def test_a_beam_wider_than_the_state_pool_waits_for_slots(model_path: str, hf) -> None:
    args = ["--model-path", model_path, "--dtype", "float32", "--max-mamba-cache-size", "2",
            "--max-running-requests", "2", *DETERMINISTIC]
    with running_server(args) as small:
        for prompt in PROMPTS:
            assert_same(beam_request(small, prompt, 4, 5, 1.0), reference(hf, prompt, 4, 5, 1.0))
        assert small.metric("hyssm_admission_refusals_total", reason="mamba_state") > 0  # step requests waited
        with small.client() as c:
            assert c.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}).is_success


def test_openai_sdk_beam_search_streamed_and_not(server: Server, hf) -> None:
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    prompt = PROMPTS[0]
    want = reference(hf, prompt, 3, 6, 1.3)
    extra = {"use_beam_search": True, "length_penalty": 1.3, "return_token_ids": True}
    whole = client.completions.create(model=server_model(client), prompt=prompt, n=3, max_tokens=6, extra_body=extra)
    assert [c.token_ids for c in whole.choices] == [w["ids"] for w in want]  # type: ignore[attr-defined]
    stream = client.completions.create(model=server_model(client), prompt=prompt, n=3, max_tokens=6,
                                       extra_body=extra, stream=True)
    chunks = {c.choices[0].index: c.choices[0] for c in stream if c.choices}
    assert [chunks[i].text for i in range(3)] == [c.text for c in whole.choices]
    assert [chunks[i].finish_reason for i in range(3)] == [w["reason"] for w in want]


def server_model(client) -> str:
    return client.models.list().data[0].id
