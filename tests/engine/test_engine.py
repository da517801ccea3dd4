"""hyssm.Engine over the built-in model: the same answers as the HTTP server, streaming, chat, n > 1,
structured output, errors naming the problem, and a shutdown that leaves no process."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest

import hyssm
from shared.config import builtin_model_dir
from tests.e2e.server import DETERMINISTIC, ROOT, Server, free_port, running_server
from tests.engine.conftest import hyssm_children, listening_tcp_ports, wait_gone

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

PROMPTS = ["Once upon a time", "The quick brown fox", "Hello"]
SEEDED = {"max_new_tokens": 12, "temperature": 0.8, "top_p": 0.9, "seed": 7, "ignore_eos": True}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """The HTTP server the engine must agree with (tests/e2e/server.py launches it as ENGINE_ARGS say)."""
    with running_server(["--random-seed", "0", *DETERMINISTIC]) as srv:
        yield srv


def comparable(result: Any) -> Any:
    """A /generate answer without what differs between two identical runs (request id, latency)."""
    if isinstance(result, list):
        return [comparable(r) for r in result]
    meta = {k: v for k, v in result["meta_info"].items() if k not in ("id", "e2e_latency")}
    return {**result, "meta_info": meta}


def test_batch_generate_equals_the_http_server(engine: hyssm.Engine, server: Server) -> None:
    """Text and token-id batches, seeded sampling and n > 1: the engine's list is the server's list."""
    bodies = [
        {"text": PROMPTS, "sampling_params": SEEDED},
        {"input_ids": [[72, 105, 33], [1, 2, 3, 4, 5]], "sampling_params": {**SEEDED, "n": 2}},
        {"text": PROMPTS[0], "sampling_params": {**SEEDED, "n": 3}, "return_logprob": True},
    ]
    with server.client() as http:
        expected = [http.post("/generate", json=b).json() for b in bodies]
    got = [
        engine.generate(PROMPTS, hyssm.SamplingParams(**SEEDED)),
        engine.generate(input_ids=[[72, 105, 33], [1, 2, 3, 4, 5]], sampling_params={**SEEDED, "n": 2}),
        engine.generate(PROMPTS[0], hyssm.SamplingParams(**SEEDED, n=3), return_logprob=True),
    ]
    assert [comparable(g) for g in got] == [comparable(e) for e in expected]
    assert [len(g) for g in got] == [3, 4, 3]
    per_prompt = [hyssm.SamplingParams(**{**SEEDED, "max_new_tokens": 3 + i}) for i in range(3)]
    each = engine.generate(PROMPTS, per_prompt)  # a list of sampling params: one per prompt
    alone = [engine.generate(p, sp) for p, sp in zip(PROMPTS, per_prompt, strict=True)]
    assert [r["output_ids"] for r in each] == [r["output_ids"] for r in alone]
    assert [r["meta_info"]["completion_tokens"] for r in each] == [3, 4, 5]
    first = got[0][0]["meta_info"]
    assert first["finish_reason"] == {"type": "length", "length": 12} and first["completion_tokens"] == 12
    assert "cached_tokens" in first and first["prompt_tokens"] > 0
    logprobs = got[2][0]["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in logprobs] == got[2][0]["output_ids"]


def test_results_are_in_input_order(engine: hyssm.Engine) -> None:
    greedy = hyssm.SamplingParams(max_tokens=8, temperature=0)  # vLLM's name for max_new_tokens
    alone = [engine.generate(p, greedy)["text"] for p in PROMPTS]
    assert [r["text"] for r in engine.generate(PROMPTS, greedy)] == alone
    assert [r["text"] for r in engine.generate(PROMPTS[::-1], greedy)] == alone[::-1]


def test_n_choices_are_the_seeds_in_turn(engine: hyssm.Engine) -> None:
    """Choice i of a seeded request with n > 1 is that request with seed + i (as over HTTP)."""
    sp = {**SEEDED, "n": 3}
    choices = engine.generate(PROMPTS[1], sp)
    singles = [engine.generate(PROMPTS[1], {**SEEDED, "seed": SEEDED["seed"] + i}) for i in range(3)]
    assert [c["output_ids"] for c in choices] == [s["output_ids"] for s in singles]


def test_vllm_field_names(engine: hyssm.Engine) -> None:
    """max_tokens / min_tokens / logprobs mean what they mean in vLLM, on generate and on chat."""
    sp = hyssm.SamplingParams(max_tokens=3, min_tokens=3, logprobs=2, temperature=0)
    meta = engine.generate("Hi", sp)["meta_info"]
    assert meta["completion_tokens"] == 3
    assert len(meta["output_token_logprobs"]) == 3 and [len(t) for t in meta["output_top_logprobs"]] == [2, 2, 2]
    chat = engine.chat([{"role": "user", "content": "Hi"}], sp)
    assert chat["usage"]["completion_tokens"] == 3
    assert [len(t["top_logprobs"]) for t in chat["choices"][0]["logprobs"]["content"]] == [2, 2, 2]


def test_async_streaming(engine: hyssm.Engine) -> None:
    """Streams grow cumulatively to the non-streamed answer; several run at once on one loop."""
    greedy = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}

    async def stream(prompt: str) -> list[dict[str, Any]]:
        return [chunk async for chunk in await engine.async_generate(prompt, greedy, stream=True)]

    async def main() -> tuple[list[list[dict[str, Any]]], Any]:
        streams = await asyncio.gather(*(stream(p) for p in PROMPTS))
        return streams, await engine.async_generate(PROMPTS, greedy)

    streams, whole = asyncio.run(main())
    for chunks, answer in zip(streams, whole, strict=True):
        assert len(chunks) > 1
        texts = [c["text"] for c in chunks]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
        assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
        assert chunks[-1]["text"] == answer["text"] and chunks[-1]["output_ids"] == answer["output_ids"]
        assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 10}


def test_chat_goes_through_the_chat_template(engine: hyssm.Engine, server: Server) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    got = engine.chat(messages, {"max_new_tokens": 8, "temperature": 0})
    with server.client() as http:
        want = http.post("/v1/chat/completions", json={
            "model": "hyssm-tiny", "messages": messages, "max_tokens": 8, "temperature": 0,
            "return_token_ids": True}).json()
        rendered = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": True}).json()
    assert got["choices"][0]["message"] == want["choices"][0]["message"]
    assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    assert got["prompt_token_ids"] == rendered["tokens"]
    assert got["usage"]["completion_tokens"] == 8 and got["choices"][0]["finish_reason"] == "length"


def test_async_chat_streams_the_same_content(engine: hyssm.Engine) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    sp = {"max_new_tokens": 6, "temperature": 0}
    whole = engine.chat(messages, sp)

    async def main() -> str:
        it = await engine.async_chat(messages, sp, stream=True)
        return "".join([c["choices"][0]["delta"].get("content") or "" async for c in it if c["choices"]])

    assert asyncio.run(main()) == whole["choices"][0]["message"]["content"]


def test_structured_output(engine: hyssm.Engine) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # bounded: every output that fits it is short
    out = engine.generate(PROMPTS, {"max_new_tokens": 40, "temperature": 0.7, "seed": 1, "json_schema": schema})
    for r in out:
        assert r["meta_info"]["finish_reason"]["type"] == "stop", r
        jsonschema.validate(json.loads(r["text"]), schema)
    choices = engine.generate("x", hyssm.SamplingParams(max_new_tokens=8, regex="[ab]{4}", n=2, seed=3))
    assert len(choices) == 2 and all(re.fullmatch("[ab]{4}", c["text"]) for c in choices)
    chat = engine.chat([{"role": "user", "content": "a number"}], {"max_tokens": 40},
                       response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    jsonschema.validate(json.loads(chat["choices"][0]["message"]["content"]), schema)


def test_errors_name_the_problem(engine: hyssm.Engine) -> None:
    with pytest.raises(hyssm.RequestError, match="temperature") as e:
        engine.generate("x", {"temperature": -1.0})
    assert e.value.status == 400 and e.value.param == "sampling_params.temperature"
    with pytest.raises(hyssm.RequestError, match="regex"):
        engine.generate("x", {"regex": "a("})
    unmeetable = {"regex": "ab", "min_tokens": 5, "max_new_tokens": 8}  # found while it runs
    with pytest.raises(hyssm.RequestError, match="min_tokens 5 cannot be met") as e:
        engine.generate("x", unmeetable)
    assert e.value.status == 400

    async def streamed() -> None:
        async for _ in await engine.async_generate("x", unmeetable, stream=True):
            pass

    with pytest.raises(hyssm.RequestError, match="min_tokens 5 cannot be met"):
        asyncio.run(streamed())
    with pytest.raises(TypeError, match="'max_length'"):
        engine.generate("x", {"max_length": 3})
    with pytest.raises(ValueError, match="exactly one of prompt and input_ids"):
        engine.generate()
    with pytest.raises(ValueError, match="max_tokens=4 and max_new_tokens=5"):
        hyssm.SamplingParams(max_tokens=4, max_new_tokens=5)
    assert engine.generate("x", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] <= 2


def test_bad_engine_arguments_start_nothing(tmp_path) -> None:
    with pytest.raises(TypeError, match="'tp_sise'"):
        hyssm.Engine(model_path="builtin", tp_sise=2)
    with pytest.raises(hyssm.ConfigError, match="--max-running-requests"):
        hyssm.Engine(model_path="builtin", max_running_requests=0)
    missing = str(tmp_path / "no-such-checkpoint")
    with pytest.raises(hyssm.EngineError, match="no-such-checkpoint"):
        hyssm.Engine(model_path=missing, device="cpu")


def test_a_process_failing_to_start_is_an_error_and_leaves_nothing(tmp_path) -> None:
    """A checkpoint without tokenizer files passes the preflight; the tokenizer process refuses it."""
    model = tmp_path / "no-tokenizer"
    model.mkdir()
    for name in ("config.json", "model.safetensors"):
        (model / name).symlink_to(os.path.join(builtin_model_dir(), name))
    before = set(hyssm_children())
    with pytest.raises(hyssm.EngineError, match="did not start: tokenizer: .*tokenizer"):
        hyssm.Engine(model_path=str(model), device="cpu")
    assert wait_gone(sorted(set(hyssm_children()) - before)) == []


def test_no_tcp_port_unless_asked(engine: hyssm.Engine) -> None:
    assert listening_tcp_ports(engine.pids["tokenizer"]) == []
    port = free_port()
    with hyssm.Engine(model_path="builtin", device="cpu", port=port) as eng:
        assert listening_tcp_ports(eng.pids["tokenizer"]) == [port] and eng.url == f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=eng.url, timeout=60) as http:
            assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["hyssm-tiny"]
        assert eng.generate("Hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


def test_shutdown_leaves_no_process() -> None:
    with hyssm.Engine(model_path="builtin", device="cpu") as eng:
        pids = eng.pids
        run_dir = eng.args.run_dir
        assert set(pids) == {"tokenizer", "scheduler", "worker-tp0"}
        assert eng.generate("Hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2
        assert os.path.exists(os.path.join(run_dir, "http.sock"))
    assert wait_gone(list(pids.values()), timeout=1.0) == []
    assert not os.path.exists(run_dir)
    with pytest.raises(hyssm.EngineDeadError, match="shut down"):
        eng.generate("Hi")
    eng.shutdown()  # idempotent


UNGUARDED = """
import hyssm
print("script ran", flush=True)
with hyssm.Engine(model_path="builtin", device="cpu") as eng:
    print("tokens", eng.generate("Hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"], flush=True)
"""


def test_a_script_creating_an_engine_needs_no_main_guard(tmp_path) -> None:
    """The engine's processes do not import the script that creates it: a script without an
    `if __name__ == "__main__":` guard runs once and gets its answer."""
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n").count("script ran") == 1 and "tokens 2" in out.stdout, out.stdout
