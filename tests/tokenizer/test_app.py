"""The HTTP app over a fake backend (httpx.ASGITransport): native and OpenAI endpoints,
streaming, stop strings, logprobs, health/info/flush/metrics, API key, backend failure."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import msgspec
import openai
import pytest

from shared.config import ServerArgs
from shared.messages import MetricRecord, SchedulerInfo, ServerState
from tests.tokenizer.conftest import EOS, FakeBackend, text_plan
from tokenizer_proc import create_app
from tokenizer_proc.context import AppContext
from tokenizer_proc.requests.tokenizer import TextTokenizer

Check = Callable[[httpx.AsyncClient], Awaitable[None]]


def serve(args: ServerArgs, backend: FakeBackend, tok: TextTokenizer, check: Check) -> AppContext:
    """Run `check` against a fresh app; afterwards nothing may be left in flight (nor counted by /load)."""
    app = create_app(args, backend, tok)  # type: ignore[arg-type]

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            await check(client)

    asyncio.run(main())
    ctx: AppContext = app.state.ctx
    ctx.check_integrity()
    assert len(ctx.in_flight) == 0 and ctx.server_load == 0
    backend.check_integrity()
    return ctx


def sse_events(text: str) -> list[Any]:
    lines = [ln[len("data: "):] for ln in text.split("\n") if ln.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", text
    return [json.loads(x) for x in lines[:-1]]


def test_generate_non_streaming(args, backend, tok) -> None:
    async def check(c: httpx.AsyncClient) -> None:
        r = await c.post("/generate", json={"text": "abc", "sampling_params": {"max_new_tokens": 5}})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["text"] == "hello"
        assert body["output_ids"] == list(b"hello")
        meta = body["meta_info"]
        assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 5
        assert meta["finish_reason"] == {"type": "length", "length": 5}
        assert meta["id"] == backend.submitted[0].rid

    serve(args, backend, tok, check)
    assert backend.submitted[0].input_ids == list(b"abc")
    assert backend.submitted[0].sampling.max_new_tokens == 5


def test_generate_streaming_is_cumulative(args, backend, tok) -> None:
    backend.plan = text_plan("héllo wörld", per_out=1)

    async def check(c: httpx.AsyncClient) -> None:
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 13, "temperature": 0}, "rid": "r1"}
        whole = (await c.post("/generate", json=body)).json()
        r = await c.post("/generate", json={**body, "stream": True, "rid": "r2"})
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.text)
        texts = [e["text"] for e in events]
        assert texts[-1] == whole["text"] == "héllo wörld"
        assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))
        assert all("\ufffd" not in t for t in texts)
        assert events[-1]["output_ids"] == whole["output_ids"]
        assert [e["meta_info"]["finish_reason"] for e in events[:-1]] == [None] * (len(events) - 1)
        assert events[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]

    serve(args, backend, tok, check)


def test_stop_token_and_eos_finish(args, backend, tok) -> None:
    backend.plan = lambda req: [[ord("o"), ord("k"), EOS, ord("z")]]

    async def check(c: httpx.AsyncClient) -> None:
        r = (await c.post("/generate", json={"input_ids": [5]})).json()
        assert r["text"] == "ok" and r["output_ids"] == [ord("o"), ord("k"), EOS]
        assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}
        sp = {"stop_token_ids": [ord("k")]}
        r = (await c.post("/generate", json={"input_ids": [5], "sampling_params": sp})).json()
        assert r["text"] == "ok" and r["meta_info"]["finish_reason"]["matched"] == ord("k")

    serve(args, backend, tok, check)
    assert backend.submitted[1].sampling.stop_token_ids == [ord("k")]


def test_stop_string_across_tokens_truncates_and_aborts(args, backend, tok) -> None:
    backend.plan = text_plan("hello world ", per_out=2)

    async def check(c: httpx.AsyncClient) -> None:
        sp = {"max_new_tokens": 40, "stop": ["o w", "zzz"]}
        r = (await c.post("/generate", json={"text": "x", "sampling_params": sp})).json()
        assert r["text"] == "hell"
        assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": "o w"}
        r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 40, "stop": "wor", "stream": True})
        events = sse_events(r.text)
        assert "".join(e["choices"][0]["text"] for e in events) == "hello "
        assert events[-1]["choices"][0]["finish_reason"] == "stop"

    serve(args, backend, tok, check)
    assert [reason for _, reason in backend.aborted] == ["stop string matched"] * 2
    assert {rid for rid, _ in backend.aborted} == {r.rid for r in backend.submitted}


def test_completions_usage_and_streaming_usage(args, backend, tok) -> None:
    backend.cached_tokens = 2

    async def check(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/completions", json={"model": args.model_name, "prompt": "four", "max_tokens": 7})
        body = r.json()
        assert r.status_code == 200 and body["object"] == "text_completion"
        assert body["choices"][0]["text"] == "hello w" and body["choices"][0]["finish_reason"] == "length"
        assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 7, "total_tokens": 11,
                                 "prompt_tokens_details": {"cached_tokens": 2}}
        assert body["model"] == args.model_name and body["id"].startswith("cmpl-")
        r = await c.post("/v1/completions", json={"prompt": [[1, 2, 3]], "max_tokens": 3, "stream": True,
                                                  "stream_options": {"include_usage": True}})
        events = sse_events(r.text)
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
        assert events[-1]["usage"]["prompt_tokens"] == 3
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "hel"

    serve(args, backend, tok, check)
    assert backend.submitted[0].sampling.max_new_tokens == 7


def test_completion_default_max_tokens_is_16(args, backend, tok) -> None:
    async def check(c: httpx.AsyncClient) -> None:
        assert (await c.post("/v1/completions", json={"prompt": "a"})).status_code == 200

    serve(args, backend, tok, check)
    assert backend.submitted[0].sampling.max_new_tokens == 16


def test_chat_completions(args, backend, tok) -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]

    async def check(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 4})
        body = r.json()
        assert r.status_code == 200, r.text
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"] == {"role": "assistant", "content": "hell"}
        r = await c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4, "stream": True})
        events = sse_events(r.text)
        assert events[0]["object"] == "chat.completion.chunk"
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == "hell"
        assert events[-1]["choices"][0]["finish_reason"] == "length"

    serve(args, backend, tok, check)
    expected = tok.encode(tok.render_chat([{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]),
                          add_special_tokens=False)
    assert backend.submitted[0].input_ids == expected


def test_chat_default_max_tokens_fills_the_context(args, backend, tok) -> None:
    async def check(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 70}]})
        assert r.status_code == 200

    serve(args, backend, tok, check)
    req = backend.submitted[0]
    # 128-token context: what the prompt leaves (capped by --max-new-tokens-limit 64)
    assert req.sampling.max_new_tokens == min(64, 128 - len(req.input_ids))


def test_openai_client_against_the_app(args, backend, tok) -> None:
    async def check(c: httpx.AsyncClient) -> None:
        client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="k", http_client=c)
        model = (await client.models.list()).data[0].id
        assert model == args.model_name
        comp = await client.completions.create(model=model, prompt="The cat", max_tokens=6, temperature=0)
        assert comp.choices[0].text == "hello " and comp.usage.prompt_tokens == 7
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "yo"}], max_tokens=5, stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            usage = chunk.usage or usage
        assert text == "hello" and usage is not None and usage.completion_tokens == 5
        assert usage.prompt_tokens_details.cached_tokens == 0

    serve(args, backend, tok, check)


def test_logprobs(args, backend, tok) -> None:
    async def check(c: httpx.AsyncClient) -> None:
        r = (await c.post("/generate", json={"text": "a", "return_logprob": True,
                                             "sampling_params": {"max_new_tokens": 2}})).json()
        assert r["meta_info"]["output_token_logprobs"] == [[-0.5, ord("h"), None], [-0.5, ord("e"), None]]
        r = (await c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "logprobs": 0})).json()
        lp = r["choices"][0]["logprobs"]
        assert lp["tokens"] == ["h", "e"] and lp["token_logprobs"] == [-0.5, -0.5] and lp["text_offset"] == [0, 1]
        r = (await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}],
                                                        "max_tokens": 1, "logprobs": True})).json()
        assert r["choices"][0]["logprobs"]["content"][0]["token"] == "h"

    serve(args, backend, tok, check)
    assert [r.sampling.logprobs for r in backend.submitted] == [True, True, True]


def test_health_info_flush_models(args, backend, tok) -> None:
    backend.info_doc = SchedulerInfo(server=ServerState(num_running=1, kv_capacity=100), in_flight_step=4)

    async def check(c: httpx.AsyncClient) -> None:
        assert (await c.get("/health")).status_code == 200
        info = (await c.get("/get_server_info")).json()
        assert info["scheduler"] == msgspec.to_builtins(backend.info_doc)
        assert info["scheduler"]["server"]["kv_capacity"] == 100 and info["scheduler"]["in_flight_step"] == 4
        assert info["server_args"]["max_new_tokens_limit"] == 64 and info["context_length"] == 128
        assert (await c.get("/v1/models")).json()["data"][0]["id"] == args.model_name
        assert (await c.get("/get_model_info")).json()["is_generation"] is True
        assert (await c.post("/flush_cache")).json()["success"] is True
        backend.flush_result = (False, "requests are running")
        r = await c.post("/flush_cache")
        assert r.status_code == 400 and "requests are running" in r.json()["error"]["message"]
        r = await c.get("/nope")
        assert r.status_code == 404 and r.json()["error"]["code"] == 404
        r = await c.get("/generate")
        assert r.status_code == 405 and "error" in r.json()

    serve(args, backend, tok, check)


def test_metrics_render_scheduler_items_and_http_counters(args, backend, tok) -> None:
    backend.info_doc = SchedulerInfo(server=ServerState(), metrics=[
        MetricRecord(name="hyssm_num_running_reqs", type="gauge", help="running", labels={}, value=3.0),
        MetricRecord(name="hyssm_prefix_hits_total", type="counter", help="hits", labels={"kind": "kv"}, value=7),
        MetricRecord(name="hyssm_prefix_hits_total", type="counter", help="hits", labels={"kind": "mamba"}, value=2),
    ])  # fmt: skip

    async def check(c: httpx.AsyncClient) -> None:
        await c.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 1}})
        await c.post("/generate", json={"text": ""})
        text = (await c.get("/metrics")).text
        assert "hyssm_num_running_reqs 3.0" in text
        assert 'hyssm_prefix_hits_total{kind="kv"} 7.0' in text
        assert 'hyssm_prefix_hits_total{kind="mamba"} 2.0' in text
        assert 'hyssm_http_requests_total{endpoint="/generate",status="200"} 1.0' in text
        assert 'hyssm_http_requests_total{endpoint="/generate",status="400"} 1.0' in text
        assert 'hyssm_http_bad_requests_total{endpoint="/generate"} 1.0' in text
        assert "hyssm_scheduler_up 1.0" in text

    serve(args, backend, tok, check)


def test_api_key(model_dir, backend, tok) -> None:
    args = ServerArgs(model_path=model_dir, api_key="sekrit")

    async def check(c: httpx.AsyncClient) -> None:
        r = await c.post("/generate", json={"text": "a"})
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
        r = await c.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        assert (await c.get("/get_server_info")).status_code == 401
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/metrics")).status_code == 200
        r = await c.get("/v1/models", headers={"Authorization": "Bearer sekrit"})
        assert r.status_code == 200
        info = (await c.get("/get_server_info", headers={"Authorization": "Bearer sekrit"})).json()
        assert "sekrit" not in json.dumps(info)

    serve(args, backend, tok, check)
    assert [r.rid for r in backend.submitted if not r.rid.startswith("health-")] == []  # only /health's probe


def test_backend_failure_mid_request(args, backend, tok) -> None:
    backend.fail_with = "scheduler died"

    async def check(c: httpx.AsyncClient) -> None:
        r = await c.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 5}})
        assert r.status_code == 503 and "scheduler died" in r.json()["error"]["message"]
        r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}],
                                                       "max_tokens": 5, "stream": True})
        lines = [ln for ln in r.text.split("\n") if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert "scheduler died" in json.loads(lines[-2][6:])["error"]["message"]
        r = await c.post("/v1/completions", json={"prompt": "a", "max_tokens": 5})
        assert r.status_code == 503

    serve(args, backend, tok, check)


def test_unhealthy_backend(args, backend, tok) -> None:
    backend.healthy = False

    async def check(c: httpx.AsyncClient) -> None:
        assert (await c.get("/health")).status_code == 503
        for stream in (False, True):
            r = await c.post("/generate", json={"text": "a", "stream": stream})
            assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert (await c.get("/get_server_info")).status_code == 503
        assert "hyssm_scheduler_up 0.0" in (await c.get("/metrics")).text

    serve(args, backend, tok, check)
    assert backend.submitted == []


def test_duplicate_rid_in_flight_is_rejected(args, backend, tok) -> None:
    backend.gate = asyncio.Event()

    async def check(c: httpx.AsyncClient) -> None:
        body = {"text": "a", "rid": "same", "sampling_params": {"max_new_tokens": 3}}
        first = asyncio.create_task(c.post("/generate", json=body))
        while not backend.submitted:  # wait for the first to be in flight (it then waits on the gate)
            await asyncio.sleep(0)
        second = await c.post("/generate", json=body)
        assert second.status_code == 400 and "same" in second.json()["error"]["message"]
        backend.gate.set()
        assert (await first).status_code == 200

    serve(args, backend, tok, check)
    assert len(backend.submitted) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_many_concurrent_requests(args, backend, tok, stream: bool) -> None:
    async def check(c: httpx.AsyncClient) -> None:
        bodies = [{"input_ids": [i + 1], "stream": stream, "sampling_params": {"max_new_tokens": 1 + i % 9}}
                  for i in range(40)]
        results = await asyncio.gather(*(c.post("/generate", json=b) for b in bodies))
        for b, r in zip(bodies, results, strict=True):
            text = sse_events(r.text)[-1]["text"] if stream else r.json()["text"]
            assert text == "hello world "[: b["sampling_params"]["max_new_tokens"]]

    serve(args, backend, tok, check)
    assert len(backend.submitted) == 40
