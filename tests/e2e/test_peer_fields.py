"""vLLM / SGLang request fields through a real launch.py, with the openai SDK (extra_body) and raw
httpx: structured_outputs and SGLang's regex, prompt_logprobs (equal to the model's own, ranks
included), return_token_ids, truncate_prompt_tokens, continuous usage stats, logprobs=0, stop_regex
(also on /generate), continue_final_message, custom roles, /tokenize with tools, the model card's
root, and beam search refusing a best_of other than n."""

from __future__ import annotations

import json
import math
import re

import httpx
import openai
import pytest

from shared.config import builtin_model_dir
from tests.e2e.server import Server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

MODEL = "hyssm-tiny"
MSGS = [{"role": "user", "content": "Say something."}]
GREEDY = {"model": MODEL, "temperature": 0}


@pytest.fixture(scope="module")
def server(api_server: Server) -> Server:
    return api_server


def _reference(runner, ids: list[int]):
    """log-softmax of the model's logits at every position of `ids`, alone: [len(ids), V]."""
    import torch

    from shared.messages import ForwardBatch, ReqSlice
    from tests.model_driver import forward_all_logits

    sl = ReqSlice(rid="peer", input_ids=ids, start_pos=0, kv_slots=list(range(1, len(ids) + 1)), state_slot=1,
                  sample=True)
    logits = forward_all_logits(runner, ForwardBatch(step=0, reqs=[sl], clears=[1]))["peer"]
    return torch.log_softmax(logits.float(), dim=-1)


def test_prompt_logprobs_are_the_models(server: Server, reference_runner) -> None:
    ids = list(b"Peer fields: prompt logprobs")
    logp = _reference(reference_runner, ids)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/v1/completions", json={**GREEDY, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 2})
        assert r.status_code == 200, r.text
        plp = r.json()["choices"][0]["prompt_logprobs"]
        chat = c.post("/v1/chat/completions", json={**GREEDY, "messages": MSGS, "max_tokens": 1,
                                                   "prompt_logprobs": 0}).json()
    assert plp[0] is None and len(plp) == len(ids)
    for i, entry in enumerate(plp[1:]):
        t = ids[i + 1]
        own = entry[str(t)]
        assert math.isclose(own["logprob"], logp[i, t].item(), abs_tol=2e-3)
        sure_above, maybe_above = (int((logp[i] >= logp[i, t] + d).sum()) for d in (2e-3, -2e-3))
        assert sure_above + 1 <= own["rank"] <= maybe_above  # ties within the numerics may swap
        assert own["decoded_token"] == bytes([t]).decode("utf-8", "replace")
        ranked = sorted(entry.values(), key=lambda v: v["rank"])  # the prompt token and the two most likely
        assert len(entry) in (2, 3) and [v["rank"] for v in ranked][:2] == [1, 2]
        assert math.isclose(ranked[0]["logprob"], logp[i].max().item(), abs_tol=2e-3)
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])


def test_structured_outputs_and_regex(openai_client: openai.OpenAI) -> None:
    r = openai_client.completions.create(**GREEDY, prompt="x", max_tokens=8,
                                         extra_body={"structured_outputs": {"regex": "[ab]{4}"}})
    assert re.fullmatch("[ab]{4}", r.choices[0].text)
    r = openai_client.chat.completions.create(**GREEDY, messages=MSGS, max_tokens=8,
                                              extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].message.content in ("yes", "no")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    r = openai_client.chat.completions.create(**GREEDY, messages=MSGS, max_tokens=20,
                                              extra_body={"structured_outputs": {"json": schema}})
    assert set(json.loads(r.choices[0].message.content)) == {"n"}
    r = openai_client.completions.create(**GREEDY, prompt="x", max_tokens=6, extra_body={"regex": "[0-9]{3}"})
    assert re.fullmatch("[0-9]{3}", r.choices[0].text)
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.completions.create(**GREEDY, prompt="x", extra_body={"structured_outputs": {"regex": "a("}})
    assert e.value.param == "structured_outputs.regex"
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.completions.create(**GREEDY, prompt="x", extra_body={"structured_outputs": {"regex": "a"},
                                                                           "guided_choice": ["b"]})
    assert e.value.param == "structured_outputs.regex"  # the second constraint given


def test_return_token_ids_and_truncation(openai_client: openai.OpenAI, server: Server) -> None:
    r = openai_client.completions.create(**GREEDY, prompt="Tokens", max_tokens=5,
                                         extra_body={"return_token_ids": True})
    ch = r.choices[0]
    with httpx.Client(base_url=server.url, timeout=60) as c:
        assert c.post("/detokenize", json={"tokens": ch.token_ids}).json()["prompt"] == ch.text
    assert ch.prompt_token_ids == list(b"Tokens")
    streamed: list[int] = []
    for chunk in openai_client.chat.completions.create(**GREEDY, messages=MSGS, max_tokens=5, stream=True,
                                                       extra_body={"return_token_ids": True}):
        streamed += chunk.choices[0].token_ids or []
    whole = openai_client.chat.completions.create(**GREEDY, messages=MSGS, max_tokens=5,
                                                  extra_body={"return_token_ids": True})
    assert streamed == whole.choices[0].token_ids and len(whole.prompt_token_ids) == whole.usage.prompt_tokens
    r = openai_client.completions.create(**GREEDY, prompt="a long prompt to cut", max_tokens=2,
                                         extra_body={"truncate_prompt_tokens": 4})
    assert r.usage.prompt_tokens == 4
    cut = openai_client.completions.create(**GREEDY, prompt=" cut", max_tokens=2)
    assert r.choices[0].text == cut.choices[0].text  # the model saw the last four tokens only


def test_continuous_usage_and_logprobs_zero(openai_client: openai.OpenAI) -> None:
    chunks = list(openai_client.completions.create(**GREEDY, prompt="Usage", max_tokens=4, stream=True,
                                                   stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 4 and chunks[-1].usage.prompt_tokens == 5
    r = openai_client.completions.create(**GREEDY, prompt="Zero", max_tokens=3, logprobs=0)
    lp = r.choices[0].logprobs
    assert [list(t) for t in lp.top_logprobs] == [[tok] for tok in lp.tokens]
    assert [next(iter(t.values())) for t in lp.top_logprobs] == lp.token_logprobs


def test_stop_regex(server: Server) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        body = {**GREEDY, "prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True}
        free = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
        cut = len(free) // 2
        pattern = re.escape(free[cut : cut + 2]) + "+"
        start = re.search(pattern, free).start()
        r = c.post("/v1/completions", json={**body, "stop_regex": pattern}).json()["choices"][0]
        assert (r["text"], r["finish_reason"], r["matched_stop"]) == (free[:start], "stop", pattern)
        events = [json.loads(ln[6:]) for ln in c.post("/v1/completions", json={**body, "stop_regex": [pattern],
                                                                               "stream": True}).text.splitlines()
                  if ln.startswith("data: {")]
        assert "".join(e["choices"][0]["text"] for e in events) == free[:start]
        native = c.post("/generate", json={"text": "Once upon a time", "sampling_params": {
            "max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "stop_regex": pattern}}).json()
        assert native["text"] == free[:start]
        assert native["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}


def test_continue_final_message_and_custom_roles(openai_client: openai.OpenAI, server: Server) -> None:
    msgs = [*MSGS, {"role": "assistant", "content": "Well, I think"}]
    r = openai_client.chat.completions.create(**GREEDY, messages=msgs, max_tokens=6,
                                              extra_body={"continue_final_message": True,
                                                          "add_generation_prompt": False})
    with httpx.Client(base_url=server.url, timeout=60) as c:
        ids = c.post("/tokenize", json={"messages": msgs, "continue_final_message": True}).json()["tokens"]
        prompt_text = c.post("/detokenize", json={"tokens": ids}).json()["prompt"]
        roles = [{"role": "narrator", "content": "It was late."}, *MSGS]
        custom = c.post("/v1/chat/completions", json={**GREEDY, "messages": roles, "max_tokens": 2})
        tok = c.post("/tokenize", json={"messages": roles}).json()
    assert prompt_text.endswith("<|start_of_role|>assistant<|end_of_role|>Well, I think")
    same = openai_client.completions.create(**GREEDY, prompt=ids, max_tokens=6)
    assert r.choices[0].message.content == same.choices[0].text and r.usage.prompt_tokens == len(ids)
    assert custom.status_code == 200 and custom.json()["usage"]["prompt_tokens"] == tok["count"]
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(**GREEDY, messages=msgs, extra_body={"continue_final_message": True,
                                                                                   "add_generation_prompt": True})
    assert e.value.param == "add_generation_prompt"


def test_tokenize_tools_models_root_and_beam_search(openai_client: openai.OpenAI, server: Server) -> None:
    tools = [{"type": "function", "function": {"name": "clock", "description": "The time.",
                                               "parameters": {"type": "object", "properties": {}}}}]
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with_tools = c.post("/tokenize", json={"messages": MSGS, "tools": tools}).json()
        plain = c.post("/tokenize", json={"messages": MSGS}).json()
        strs = c.post("/tokenize", json={"prompt": "a b", "return_token_strs": True}).json()
    chat = openai_client.chat.completions.create(**GREEDY, messages=MSGS, tools=tools, max_tokens=1)
    assert with_tools["count"] == chat.usage.prompt_tokens > plain["count"]
    assert strs["token_strs"] == ["a", "\u0120", "b"]
    assert openai_client.models.retrieve(MODEL).root == builtin_model_dir()
    assert openai_client.models.list().data[0].root == builtin_model_dir()
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.completions.create(**GREEDY, prompt="x", n=1, best_of=3, extra_body={"use_beam_search": True})
    assert e.value.param == "best_of"
