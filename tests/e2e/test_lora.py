"""LoRA adapters through a real launch.py on the built-in model, adapters made and saved by peft (every linear kind
the model has: attention q/k/v/o, Mamba in/out_proj, the shared MLP's fused input_linear / output_linear): the
openai client picks an adapter by `model` and gets what transformers + peft generate; a batch mixing adapters
and the base gives each request what it gets alone; the prefix cache never crosses adapters; adapters load and
unload while requests run; bad adapters are refused with their reason."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from shared.config import builtin_model_dir
from tests.e2e.server import DETERMINISTIC, Server, running_server
from tests.fixtures.lora_adapter import peft_greedy, write_peft_adapter

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MODEL = "hyssm-tiny"
ALL_KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "out_proj", "input_linear", "output_linear")
PROMPT = list(b"Once upon a time, in a land of hybrid models,")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    base = builtin_model_dir()
    return {
        "a": write_peft_adapter(base, str(root / "a"), ALL_KINDS, rank=8, seed=1),
        "b": write_peft_adapter(base, str(root / "b"), ("q_proj", "v_proj", "in_proj"), rank=4, seed=2, rslora=True),
        "c": write_peft_adapter(base, str(root / "c"), ("o_proj", "out_proj"), rank=16, seed=3),
        "big": write_peft_adapter(base, str(root / "big"), ("q_proj",), rank=128, seed=4),
    }


@pytest.fixture(scope="module")
def server(adapters: dict[str, str]) -> Iterator[Server]:
    args = ["--dtype", "float32", "--lora-paths", f"a={adapters['a']}", f"b={adapters['b']}",
            "--max-loras-per-batch", "2", "--max-lora-rank", "64", "--chunked-prefill-size", "16", *DETERMINISTIC]
    with running_server(args) as srv:  # fmt: skip
        yield srv


@pytest.fixture(scope="module")
def sdk(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def complete(sdk: openai.OpenAI, model: str, ids: list[int], n: int = 8) -> tuple[list[int], int]:
    """(greedy token ids, cached prompt tokens) of a completion of `ids` under `model`."""
    r = sdk.completions.create(model=model, prompt=ids, max_tokens=n, temperature=0,
                               extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    return r.choices[0].model_extra["token_ids"], r.usage.prompt_tokens_details.cached_tokens


def test_the_openai_client_picks_adapters_by_model_and_gets_peft_outputs(sdk: openai.OpenAI,
                                                                         adapters: dict[str, str]) -> None:
    assert [m.id for m in sdk.models.list().data] == [MODEL, "a", "b"]
    base = builtin_model_dir()
    got = {m: complete(sdk, m, PROMPT)[0] for m in (MODEL, "a", "b")}
    assert got[MODEL] == peft_greedy(base, None, PROMPT, 8)
    assert got["a"] == peft_greedy(base, adapters["a"], PROMPT, 8)
    assert got["b"] == peft_greedy(base, adapters["b"], PROMPT, 8)
    assert len({tuple(v) for v in got.values()}) == 3
    with pytest.raises(openai.NotFoundError, match="nope"):
        sdk.completions.create(model="nope", prompt="x", max_tokens=1)


def test_a_mixed_batch_gives_each_request_what_it_gets_alone(server: Server) -> None:
    prompts = [list(f"prompt {i}: the quick brown fox".encode()) for i in range(6)]
    models = [MODEL, "a", "b", "a", MODEL, "b"]

    def body(ids: list[int], model: str) -> dict:
        return {"model": model, "prompt": ids, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}  # fmt: skip

    with httpx.Client(base_url=server.url, timeout=120) as c:
        alone = [c.post("/v1/completions", json=body(p, m)).json()["choices"][0]["token_ids"]
                 for p, m in zip(prompts, models, strict=True)]  # fmt: skip

    async def together() -> list[list[int]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            rs = await asyncio.gather(*(c.post("/v1/completions", json=body(p, m))
                                        for p, m in zip(prompts, models, strict=True)))  # fmt: skip
        return [r.json()["choices"][0]["token_ids"] for r in rs]

    assert asyncio.run(together()) == alone


def test_the_prefix_cache_never_crosses_adapters(sdk: openai.OpenAI) -> None:
    prompt = list(b"A prompt long enough to span several prefill chunks of sixteen tokens each, twice over.")
    first_a, cached = complete(sdk, "a", prompt)
    assert cached == 0
    # the second request checkpoints the recurrent state at the branch point (its prompt's end); the third hits
    for _ in range(2):
        again_a, cached = complete(sdk, "a", prompt)
        assert again_a == first_a
    assert cached >= len(prompt) - 16, cached
    for other in ("b", MODEL):
        for _ in range(2):
            _, cached = complete(sdk, other, prompt)
            assert cached == 0, other  # A's states are never B's nor the base model's


def test_adapters_load_and_unload_while_requests_run(server: Server, sdk: openai.OpenAI,
                                                     adapters: dict[str, str]) -> None:
    base = builtin_model_dir()
    with httpx.Client(base_url=server.url, timeout=120) as c:
        r = c.post("/load_lora_adapter", json={"lora_name": "c", "lora_path": adapters["c"]})
        assert r.status_code == 200, r.text
        assert complete(sdk, "c", PROMPT)[0] == peft_greedy(base, adapters["c"], PROMPT, 8)

        async def unload_during_generation() -> tuple[list[int], int]:
            """A streamed request under c; once its first tokens arrived, c is unloaded; the stream goes on."""
            tokens: list[int] = []
            status = 0
            body = {"model": "c", "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True, "stream": True}  # fmt: skip
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as ac, \
                    ac.stream("POST", "/v1/completions", json=body) as resp:  # fmt: skip
                async for line in resp.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    tokens += json.loads(line[6:])["choices"][0].get("token_ids") or []
                    if tokens and not status:
                        status = (await ac.post("/unload_lora_adapter", json={"lora_name": "c"})).status_code
            return tokens, status

        tokens, status = asyncio.run(unload_during_generation())
        assert status == 200 and len(tokens) == 40  # the running request finished under its adapter
        assert tokens[:8] == peft_greedy(base, adapters["c"], PROMPT, 8)
        r = c.post("/v1/completions", json={"model": "c", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 404 and "c" in r.json()["error"]["message"]
        r = c.post("/load_lora_adapter", json={"lora_name": "big", "lora_path": adapters["big"]})
        assert r.status_code == 400 and "rank" in r.json()["error"]["message"], r.text
        r = c.post("/load_lora_adapter", json={"lora_name": "gone", "lora_path": "/no/such/adapter"})
        assert r.status_code == 400, r.text
        assert c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}).status_code == 200


def test_adapters_with_speculative_decoding_and_structured_output(adapters: dict[str, str]) -> None:
    """NGRAM drafts verified under the adapter change nothing of its output; a grammar holds under it."""
    base = builtin_model_dir()
    prompt = list(b"abc abc abc abc abc abc abc abc")  # a prompt the n-gram drafter finds guesses in
    args = ["--dtype", "float32", "--lora-paths", f"a={adapters['a']}", "--speculative-algorithm", "NGRAM",
            *DETERMINISTIC]  # fmt: skip
    with running_server(args) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        r = c.post("/v1/completions", json={"model": "a", "prompt": prompt, "max_tokens": 12, "temperature": 0,
                                            "ignore_eos": True, "return_token_ids": True})  # fmt: skip
        assert r.json()["choices"][0]["token_ids"] == peft_greedy(base, adapters["a"], prompt, 12)
        # a boolean: a value the grammar closes within max_tokens whatever the adapter's choices (an integer may not)
        schema = {"type": "object", "properties": {"n": {"type": "boolean"}}, "required": ["n"],
                  "additionalProperties": False}  # fmt: skip
        r = c.post("/v1/chat/completions", json={
            "model": "a", "messages": [{"role": "user", "content": "yes or no"}], "max_tokens": 24,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}})  # fmt: skip
        assert r.status_code == 200, r.text
        assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"])["n"], bool)
        assert srv.metric("hyssm_spec_verify_steps_total") > 0


def test_the_engine_api_takes_adapters(adapters: dict[str, str]) -> None:
    import hyssm

    base = builtin_model_dir()
    with hyssm.Engine(model_path="builtin", device="cpu", dtype="float32", lora_paths=[f"a={adapters['a']}"],
                      enable_deterministic_inference=True) as engine:  # fmt: skip
        params = hyssm.SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
        (under_a,) = engine.generate(input_ids=[PROMPT], sampling_params=params, lora_path="a")
        assert under_a["output_ids"] == peft_greedy(base, adapters["a"], PROMPT, 8)
        engine.load_lora_adapter("c", adapters["c"])
        (under_c,) = engine.generate(input_ids=[PROMPT], sampling_params=params, lora_path="c")
        assert under_c["output_ids"] == peft_greedy(base, adapters["c"], PROMPT, 8)
        engine.unload_lora_adapter("c")
        with pytest.raises(hyssm.RequestError, match="c"):
            engine.generate(input_ids=[PROMPT], sampling_params=params, lora_path="c")
