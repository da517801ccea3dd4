"""A tiny starlette app that fakes hyssm's streaming HTTP API, served by uvicorn in a thread.

It lets the bench_serving client path run for real (HTTP, SSE parsing, concurrency)
without the engine.
It speaks hyssm's /generate, OpenAI /v1/completions and llama-server's native /completion (one chunk per
token with a cumulative ``tokens_predicted``, a leading progress chunk without tokens, a final ``stop``
chunk with ``timings.cache_n``, no [DONE]); /health answers 200; ``reset(hide_server_info=True)`` drops
/get_server_info (404, as on llama-server), leaving the vocabulary to /v1/models' ``meta.n_vocab``.
/metrics reports the load gauges bench_peers' settle period reads, in both dialects
(``hyssm_num_running_reqs``, ``hyssm_http_in_flight_requests``, ``llamacpp:requests_processing``): the
streams not yet finished, plus one more while ``linger_s`` (``reset(linger_s=...)``) has not passed since
the last stream ended (a server still busy after its last response, as llama-server after a wave).
Faked behaviour: the reply token is always 7; ``cached_tokens`` is the longest common prefix with any
earlier prompt since the last /flush_cache (capped at len - 1, like the real radix cache); tokens are
streamed in chunks of 1 and 2 alternately (a batched TokenOut carries several) with a short pause
between chunks to simulate decoding; every ``fail_every``-th request gets a 503. Requests are validated
strictly (a 400 names what is wrong), so a client bug shows up as a failure.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

VOCAB_SIZE = 100
MODEL_NAME = "fake-model"
TOKEN_PAUSE_S = 0.02  # simulated decode time per chunk (load simulation, not synchronisation)


@dataclass
class Seen:
    """One request as the fake server received it."""

    endpoint: str
    prompt_ids: list[int]
    max_tokens: int
    cached_tokens: int
    body: dict[str, object]
    auth: str = ""
    arrived: float = field(default_factory=time.monotonic)


@dataclass
class FakeState:
    """Everything the fake remembers; reset between tests. Mutated only on the server thread's loop."""

    fail_every: int = 0
    hide_server_info: bool = False
    arrivals: int = 0
    flushes: int = 0
    prompts: list[list[int]] = field(default_factory=list)  # the fake "radix cache"
    seen: list[Seen] = field(default_factory=list)
    streaming: int = 0  # streams begun and not yet ended
    linger_s: float = 0.0  # reported busy this long after the last stream ended
    last_end: float = 0.0  # time.monotonic() when the last stream ended
    ended: list[float] = field(default_factory=list)  # when each stream ended

    def reset(self, fail_every: int, hide_server_info: bool = False, linger_s: float = 0.0) -> None:
        self.fail_every, self.arrivals, self.flushes = fail_every, 0, 0
        self.hide_server_info, self.linger_s, self.last_end = hide_server_info, linger_s, 0.0
        self.prompts.clear()
        self.seen.clear()
        self.ended.clear()

    def busy(self) -> int:
        lingering = self.linger_s > 0 and time.monotonic() - self.last_end < self.linger_s
        return self.streaming + int(lingering)

    async def tracked(self, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        """`chunks`, counted in `streaming` until they end (or the client goes)."""
        self.streaming += 1
        try:
            async for c in chunks:
                yield c
        finally:
            self.streaming -= 1
            self.last_end = time.monotonic()
            self.ended.append(self.last_end)

    def cached_len(self, ids: list[int]) -> int:
        best = 0
        for p in self.prompts:
            n = 0
            for a, b in zip(p, ids, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return min(best, len(ids) - 1)

    def check_integrity(self) -> None:
        assert self.arrivals >= len(self.seen)
        assert len(self.prompts) <= len(self.seen)
        for s in self.seen:
            assert 0 <= s.cached_tokens < len(s.prompt_ids)


def _bad(msg: str) -> JSONResponse:
    return JSONResponse({"error": {"message": msg, "type": "invalid_request_error"}}, status_code=400)


def _chunk_sizes(total: int) -> list[int]:
    sizes, k = [], 0
    while sum(sizes) < total:
        sizes.append(min(1 + k % 2, total - sum(sizes)))
        k += 1
    return sizes


def _sse(obj: object) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class FakeApp:
    """The starlette routes over one FakeState."""

    def __init__(self, state: FakeState) -> None:
        self.state = state
        self.app = Starlette(
            routes=[
                Route("/get_server_info", self.server_info, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/flush_cache", self.flush, methods=["POST"]),
                Route("/generate", self.generate, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/completion", self.llama_completion, methods=["POST"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
            ]
        )

    async def server_info(self, request: Request) -> JSONResponse:
        if self.state.hide_server_info:
            return JSONResponse({"error": "not found"}, status_code=404)
        return JSONResponse({"args": {"port": 0}, "model_info": {"vocab_size": VOCAB_SIZE}})

    async def models(self, request: Request) -> JSONResponse:
        model = {"id": MODEL_NAME, "object": "model", "meta": {"n_vocab": VOCAB_SIZE}}
        return JSONResponse({"object": "list", "data": [model]})

    async def health(self, request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        n = self.state.busy()
        text = (f"hyssm_num_running_reqs {n}.0\nhyssm_num_waiting_reqs 0.0\nhyssm_http_in_flight_requests {n}.0\n"
                f"llamacpp:requests_processing {n}\nllamacpp:requests_deferred 0\n")  # fmt: skip
        return Response(text, media_type="text/plain; version=0.0.4")

    async def flush(self, request: Request) -> JSONResponse:
        self.state.flushes += 1
        self.state.prompts.clear()
        return JSONResponse({"success": True})

    def _admit(self, endpoint: str, ids: object, max_tokens: object, body: dict[str, object]) -> Response | Seen:
        self.state.arrivals += 1
        if self.state.fail_every and self.state.arrivals % self.state.fail_every == 0:
            return JSONResponse({"error": {"message": "busy"}}, status_code=503)
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and 0 <= t < VOCAB_SIZE for t in ids):
            return _bad("token ids must be a non-empty list of ints in [0, vocab)")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            return _bad("max tokens must be a positive int")
        if body.get("stream") is not True:
            return _bad("this fake only streams")
        seen = Seen(endpoint, ids, max_tokens, self.state.cached_len(ids), body)
        self.state.seen.append(seen)
        self.state.prompts.append(ids)
        return seen

    async def generate(self, request: Request) -> Response:
        body = await request.json()
        params = body.get("sampling_params", {})
        if set(body) - {"input_ids", "text", "sampling_params", "stream"} or set(params) - {
            "max_new_tokens", "temperature", "ignore_eos"
        }:  # fmt: skip
            return _bad(f"unknown field in {body}")
        seen = self._admit("generate", body.get("input_ids"), params.get("max_new_tokens"), body)
        if isinstance(seen, Response):
            return seen

        async def stream() -> AsyncIterator[str]:
            done = 0
            for n in _chunk_sizes(seen.max_tokens):
                await asyncio.sleep(TOKEN_PAUSE_S)
                done += n
                meta = {"id": "r", "prompt_tokens": len(seen.prompt_ids), "completion_tokens": done,
                        "cached_tokens": seen.cached_tokens, "finish_reason": None}  # fmt: skip
                yield _sse({"text": "x" * done, "output_ids": [7] * n, "meta_info": meta})
            meta = {**meta, "finish_reason": {"type": "length", "length": done}}
            yield _sse({"text": "x" * done, "output_ids": [], "meta_info": meta})
            yield "data: [DONE]\n\n"

        return StreamingResponse(self.state.tracked(stream()), media_type="text/event-stream")

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        if body.get("model") != MODEL_NAME or body.get("stream_options") != {"include_usage": True}:
            return _bad(f"model or stream_options wrong in {body}")
        seen = self._admit("openai", body.get("prompt"), body.get("max_tokens"), body)
        if isinstance(seen, Response):
            return seen
        seen.auth = request.headers.get("authorization", "")

        async def stream() -> AsyncIterator[str]:
            for i in range(seen.max_tokens):
                await asyncio.sleep(TOKEN_PAUSE_S)
                text = "" if i % 3 == 1 else "x"  # some chunks hold back partial UTF-8
                yield _sse(
                    {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": None}]}
                )
            yield _sse({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
            usage = {"prompt_tokens": len(seen.prompt_ids), "completion_tokens": seen.max_tokens,
                     "total_tokens": len(seen.prompt_ids) + seen.max_tokens,
                     "prompt_tokens_details": {"cached_tokens": seen.cached_tokens}}  # fmt: skip
            yield _sse({"choices": [], "usage": usage})
            yield "data: [DONE]\n\n"

        return StreamingResponse(self.state.tracked(stream()), media_type="text/event-stream")


    async def llama_completion(self, request: Request) -> Response:
        body = await request.json()
        allowed = {"prompt", "n_predict", "temperature", "stream", "cache_prompt", "ignore_eos"}
        if set(body) - allowed or body.get("cache_prompt") is not True:
            return _bad(f"unknown field or cache_prompt not true in {body}")
        seen = self._admit("llama-server", body.get("prompt"), body.get("n_predict"), body)
        if isinstance(seen, Response):
            return seen
        n_prompt = len(seen.prompt_ids)

        async def stream() -> AsyncIterator[str]:
            progress = {"content": "", "tokens": [], "stop": False, "tokens_predicted": 0}
            yield _sse({**progress, "tokens_evaluated": n_prompt})
            for i in range(seen.max_tokens):
                await asyncio.sleep(TOKEN_PAUSE_S)
                yield _sse({"index": 0, "content": "x", "tokens": [7], "stop": False, "id_slot": 0,
                            "tokens_predicted": i + 1, "tokens_evaluated": n_prompt})  # fmt: skip
            timings = {"cache_n": seen.cached_tokens, "prompt_n": n_prompt - seen.cached_tokens,
                       "predicted_n": seen.max_tokens}  # fmt: skip
            yield _sse({"index": 0, "content": "", "tokens": [], "stop": True, "tokens_predicted": seen.max_tokens,
                        "tokens_evaluated": n_prompt, "tokens_cached": n_prompt + seen.max_tokens,
                        "timings": timings})  # fmt: skip

        return StreamingResponse(self.state.tracked(stream()), media_type="text/event-stream")


class FakeServer:
    """uvicorn serving FakeApp on a free port in a daemon thread. The listening socket is bound before
    the thread starts, so clients can connect at once (the kernel queues them until uvicorn accepts)."""

    def __init__(self) -> None:
        self.state = FakeState()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.port: int = self._sock.getsockname()[1]
        config = uvicorn.Config(
            FakeApp(self.state).app, loop="asyncio", lifespan="off", log_level="warning", timeout_graceful_shutdown=2
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)
        self._thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def reset(self, fail_every: int = 0, hide_server_info: bool = False, linger_s: float = 0.0) -> None:
        """Only between client runs (no request in flight)."""
        self.state.reset(fail_every, hide_server_info, linger_s)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()
        assert not self._thread.is_alive(), "fake server did not shut down"

    def check_integrity(self) -> None:
        assert self._thread.is_alive()
        self.state.check_integrity()
