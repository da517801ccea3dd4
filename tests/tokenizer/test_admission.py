"""Admission before a response starts (tokenizer_proc/requests/admission.py) and the WebSocket /
API-key rules of the middleware, against the app over a fake backend: the queue limit's 503 with
Retry-After (streamed or not), the drain, the KV-fit 400 for streamed requests, websocket scopes."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx

from shared.config import ServerArgs
from shared.messages import SchedulerInfo, ServerState
from tests.tokenizer.conftest import FakeBackend
from tests.tokenizer.test_app import serve
from tokenizer_proc import create_app
from tokenizer_proc.requests.tokenizer import TextTokenizer
from tokenizer_proc.requests.validation import json_depth

GEN = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}


def test_requests_past_the_queue_limit_get_503_with_retry_after(args: ServerArgs, backend: FakeBackend,
                                                                 tok: TextTokenizer) -> None:  # fmt: skip
    args = dataclasses.replace(args, max_running_requests=1, max_queued_requests=1)
    backend.gate = asyncio.Event()

    async def check(c: httpx.AsyncClient) -> None:
        held = [asyncio.ensure_future(c.post("/generate", json=GEN)) for _ in range(2)]
        while len(backend.submitted) < 2:  # both admitted and submitted
            await asyncio.sleep(0)
        for stream in (False, True):
            r = await c.post("/generate", json={**GEN, "stream": stream})
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert r.headers["content-type"] == "application/json" and "--max-queued-requests" in r.text
        load = (await c.get("/get_load")).json()[0]
        assert load["num_queued_reqs"] == 1 and load["num_refused_reqs"] == 2, load
        metrics = (await c.get("/metrics")).text
        assert 'hyssm_http_refused_requests_total{reason="queue_full"} 2.0' in metrics
        assert "hyssm_http_queued_requests 1.0" in metrics
        backend.gate.set()
        assert [(await h).status_code for h in held] == [200, 200]
        assert (await c.post("/generate", json=GEN)).status_code == 200  # the queue drained

    serve(args, backend, tok, check)


def test_a_request_alone_is_admitted_whatever_its_n(args: ServerArgs, backend: FakeBackend,
                                                    tok: TextTokenizer) -> None:  # fmt: skip
    args = dataclasses.replace(args, max_running_requests=1, max_queued_requests=0)

    async def check(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/completions", json={"model": "m", "prompt": [1, 2], "max_tokens": 2, "n": 3})
        assert r.status_code == 200 and len(r.json()["choices"]) == 3, r.text

    serve(dataclasses.replace(args, served_model_name="m"), backend, tok, check)


def test_draining_refuses_new_requests_and_health(args: ServerArgs, backend: FakeBackend, tok: TextTokenizer) -> None:
    app = create_app(args, backend, tok)  # type: ignore[arg-type]

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            assert (await c.get("/health")).status_code == 200
            app.state.ctx.admission.start_draining()
            health = await c.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "draining", health.text
            for stream in (False, True):
                r = await c.post("/generate", json={**GEN, "stream": stream})
                assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"], r.text
            assert (await c.get("/v1/models")).status_code == 200  # not a generation: still answered

    asyncio.run(main())


def test_streamed_request_that_can_never_fit_is_400_before_the_stream(args: ServerArgs, backend: FakeBackend,
                                                                       tok: TextTokenizer) -> None:  # fmt: skip
    backend.info_doc = SchedulerInfo(server=ServerState(kv_capacity=20))

    async def check(c: httpx.AsyncClient) -> None:
        for stream in (True, False):
            r = await c.post("/generate", json={"input_ids": list(range(1, 19)), "stream": stream,
                                                "sampling_params": {"max_new_tokens": 8}})  # fmt: skip
            assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
            assert "can never fit the KV cache" in r.json()["error"]["message"] and "20" in r.text
        r = await c.post("/generate", json={**GEN, "stream": True})
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        assert not backend.submitted[1:]  # the refused ones never reached the scheduler

    serve(args, backend, tok, check)


def _websocket_answer(args: ServerArgs, backend: FakeBackend, tok: TextTokenizer, headers: list[tuple[bytes, bytes]],
                      extensions: dict) -> list[dict]:  # fmt: skip
    app = create_app(args, backend, tok)  # type: ignore[arg-type]
    sent: list[dict] = []
    scope = {"type": "websocket", "path": "/v1/models", "headers": headers, "extensions": extensions,
             "query_string": b"", "root_path": "", "scheme": "ws", "server": ("t", 80), "client": ("c", 1)}  # fmt: skip

    async def receive() -> dict:
        return {"type": "websocket.connect"}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


def test_websocket_scopes_are_refused_after_the_key_check(args: ServerArgs, backend: FakeBackend,
                                                          tok: TextTokenizer) -> None:  # fmt: skip
    args = dataclasses.replace(args, api_key="k")
    denial = {"websocket.http.response": {}}
    sent = _websocket_answer(args, backend, tok, [], denial)
    assert sent[0]["type"] == "websocket.http.response.start" and sent[0]["status"] == 401, sent
    assert b"API key" in sent[1]["body"]
    sent = _websocket_answer(args, backend, tok, [(b"authorization", b"bearer k")], denial)
    assert sent[0]["status"] == 400 and b"WebSocket is not supported" in sent[1]["body"], sent
    sent = _websocket_answer(args, backend, tok, [], {})  # a server without denial responses
    assert sent == [{"type": "websocket.close", "code": 1008, "reason": sent[0]["reason"]}]
    assert "API key" in sent[0]["reason"]


def test_json_depth_counts_without_recursion() -> None:
    assert json_depth(1, 5) == 0 and json_depth({}, 5) == 1 and json_depth({"a": [1, {"b": []}]}, 5) == 4
    deep: list = []
    for _ in range(100_000):  # far past the interpreter's recursion limit
        deep = [deep]
    assert json_depth(deep, 64) == 65
