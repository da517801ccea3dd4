"""No request field is dropped silently (fake backend, in process): a field a route does not declare is
a 400 naming it on every route, at the top level and in the option objects; the fields newly served
(Responses sampling extensions, /generate `logit_bias` and `sampling_seed`, /detokenize
`skip_special_tokens`) reach what they change; `metadata` has OpenAI's limits."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.tokenizer.conftest import EOS
from tests.tokenizer.test_app import serve

MSGS = [{"role": "user", "content": "hi"}]
CHAT, COMP, RESP = "/v1/chat/completions", "/v1/completions", "/v1/responses"
BASES = {
    CHAT: {"messages": MSGS, "max_tokens": 2}, COMP: {"prompt": "hi", "max_tokens": 2},
    RESP: {"input": "hi", "max_output_tokens": 2}, "/generate": {"text": "hi"}, "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [104, 105]},
}  # fmt: skip
UNKNOWN = [
    *[(path, {"frobnicate": 1}, "frobnicate") for path in BASES],
    (RESP, {"n": 2}, "n"),  # neither OpenAI's nor vLLM's Responses request has n
    (RESP, {"stop_regex": "x"}, "stop_regex"),  # nor SGLang's chat extensions
    (CHAT, {"stream": True, "stream_options": {"include_usage": True, "per_chunk": True}},
     "stream_options.per_chunk"),
    (COMP, {"structured_outputs": {"regex": "a", "flavour": 1}}, "structured_outputs.flavour"),
    (RESP, {"text": {"format": {"type": "json_object", "extra": 1}}}, "text.format.extra"),
    ("/generate", {"sampling_params": {"max_new_tokens": 2, "beam_width": 2}}, "sampling_params.beam_width"),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{}, {"temprature": 0}]}, "sampling_params[1].temprature"),
]  # fmt: skip


async def _post(c: httpx.AsyncClient, path: str, extra: dict[str, Any]) -> httpx.Response:
    return await c.post(path, json={**BASES[path], **extra})


@pytest.mark.parametrize(("path", "extra", "param"), UNKNOWN)
def test_an_unknown_field_is_a_400_naming_it(args, backend, tok, path: str, extra: dict[str, Any],
                                             param: str) -> None:  # fmt: skip
    async def check(c: httpx.AsyncClient) -> None:
        r = await _post(c, path, extra)
        assert r.status_code == 400, r.text
        assert r.json()["error"] == {"message": f"Unrecognized request argument supplied: {param}",
                                     "type": "invalid_request_error", "param": param, "code": 400}  # fmt: skip
        assert (await _post(c, path, {})).status_code == 200  # the same body without it is served

    serve(args, backend, tok, check)
    assert all(len(s.input_ids) > 0 for s in backend.submitted) and len(backend.submitted) <= 1


def test_extra_keys_of_chat_messages_and_tools_are_content(args, backend, tok) -> None:
    """Messages and tool definitions keep vLLM's tolerance: clients send earlier answers back whole."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "reasoning_content": "r",
                                                "annotations": []}, {"role": "user", "content": "ok"}]  # fmt: skip

    async def check(c: httpx.AsyncClient) -> None:
        r = await c.post(CHAT, json={"messages": msgs, "max_tokens": 2})
        assert r.status_code == 200, r.text

    serve(args, backend, tok, check)


@pytest.mark.parametrize(("path", "metadata", "param"), [
    (CHAT, {f"k{i}": "v" for i in range(17)}, "metadata"),
    (RESP, {f"k{i}": "v" for i in range(17)}, "metadata"),
    (CHAT, {"k" * 65: "v"}, "metadata." + "k" * 64),
    (RESP, {"k" * 65: "v"}, "metadata." + "k" * 64),
    (CHAT, {"k": "v" * 513}, "metadata.k"),
    (RESP, {"k": "v" * 513}, "metadata.k"),
    (CHAT, {"k": 5}, "metadata.k"),
    (COMP, {"k": "v" * 513}, "metadata.k"),
])  # fmt: skip
def test_metadata_has_openai_limits(args, backend, tok, path: str, metadata: dict[str, Any], param: str) -> None:
    async def check(c: httpx.AsyncClient) -> None:
        r = await _post(c, path, {"metadata": metadata})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), r.text
        for at_limit in ({f"k{i}": "v" for i in range(16)}, {"k" * 64: "v" * 512}):
            assert (await _post(c, path, {"metadata": at_limit})).status_code == 200

    serve(args, backend, tok, check)


def test_responses_pass_the_sampling_extensions_to_the_chat_request(args, backend, tok) -> None:
    extra = {"frequency_penalty": 0.5, "presence_penalty": 0.25, "logit_bias": {"5": 2.0}, "ignore_eos": True,
             "top_k": 3, "min_p": 0.1, "seed": 9, "repetition_penalty": 1.2, "priority": 2,
             "structured_outputs": {"regex": "[ab]+"}, "skip_special_tokens": False}  # fmt: skip

    async def check(c: httpx.AsyncClient) -> None:
        r = await _post(c, RESP, extra)
        assert r.status_code == 200, r.text

    serve(args, backend, tok, check)
    s = backend.submitted[0].sampling
    assert (s.frequency_penalty, s.presence_penalty, s.logit_bias, s.ignore_eos) == (0.5, 0.25, {5: 2.0}, True)
    assert (s.top_k, s.min_p, s.seed, s.repetition_penalty) == (3, 0.1, 9, 1.2)
    assert s.grammar is not None and (s.grammar.kind, s.grammar.source) == ("regex", "[ab]+")
    assert EOS not in s.stop_token_ids  # ignore_eos


@pytest.mark.parametrize(("extra", "param"), [
    ({"conversation": "conv_1"}, "conversation"),
    ({"conversation": {"id": "conv_1"}}, "conversation"),
    ({"prompt": {"id": "pmpt_1", "variables": {"x": "y"}}}, "prompt"),
    ({"top_logprobs": 3}, "top_logprobs"),
])  # fmt: skip
def test_responses_refuse_what_they_cannot_give(args, backend, tok, extra: dict[str, Any], param: str) -> None:
    async def check(c: httpx.AsyncClient) -> None:
        r = await _post(c, RESP, extra)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert param in r.json()["error"]["message"]
        neutral = {param: None if param != "top_logprobs" else 0}
        assert (await _post(c, RESP, neutral)).status_code == 200

    serve(args, backend, tok, check)
    assert len(backend.submitted) == 1


@pytest.mark.parametrize(("extra", "param", "value"), [
    ({"lora_path": "adapter"}, "lora_path", None),
    ({"image_data": "a.png"}, "image_data", None),
    ({"input_embeds": [[0.5, 0.5]]}, "input_embeds", None),
    ({"session_params": {"id": "s"}}, "session_params", None),
    ({"custom_logit_processor": "x"}, "custom_logit_processor", None),
    ({"bootstrap_host": "10.0.0.1"}, "bootstrap_host", None),
    ({"sampling_params": {"no_stop_trim": True}}, "sampling_params.no_stop_trim", False),
    ({"sampling_params": {"structural_tag": "{}"}}, "sampling_params.structural_tag", None),
])  # fmt: skip
def test_generate_refuses_sglang_fields_it_cannot_honour(args, backend, tok, extra: dict[str, Any], param: str,
                                                         value: Any) -> None:  # fmt: skip
    """Refused unless neutral: `value`, the neutral one, is served."""
    async def check(c: httpx.AsyncClient) -> None:
        r = await _post(c, "/generate", extra)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        name = param.rpartition(".")[2]
        neutral = {"sampling_params": {name: value}} if "." in param else {name: value}
        assert (await _post(c, "/generate", neutral)).status_code == 200

    serve(args, backend, tok, check)
    assert len(backend.submitted) == 1


def test_generate_logit_bias_and_sampling_seed_reach_the_sampler(args, backend, tok) -> None:
    async def check(c: httpx.AsyncClient) -> None:
        sp = {"max_new_tokens": 2, "logit_bias": {"7": -3.0}, "sampling_seed": 11}
        assert (await _post(c, "/generate", {"sampling_params": sp})).status_code == 200
        r = await _post(c, "/generate", {"sampling_params": {**sp, "seed": 12}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.sampling_seed", r.text

    serve(args, backend, tok, check)
    s = backend.submitted[0].sampling
    assert (s.logit_bias, s.seed) == ({7: -3.0}, 11)


def test_detokenize_skip_special_tokens(args, backend, tok) -> None:
    async def check(c: httpx.AsyncClient) -> None:
        kept = (await c.post("/v1/detokenize", json={"tokens": [104, 105, EOS]})).json()["text"]
        skipped = (await c.post("/v1/detokenize", json={"tokens": [104, 105, EOS], "skip_special_tokens": True}))
        assert skipped.json()["text"] == "hi" and kept.startswith("hi") and kept != "hi"
        vllm = (await c.post("/detokenize", json={"tokens": [104, 105, EOS], "skip_special_tokens": True})).json()
        assert vllm == {"prompt": "hi"}

    serve(args, backend, tok, check)
