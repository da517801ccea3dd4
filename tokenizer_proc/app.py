"""`create_app(args, backend)`: the Starlette app of the tokenizer process, testable without
processes (drive it with httpx.ASGITransport and a fake Backend).

Routes: POST /generate (native.py); POST /v1/completions, POST /v1/chat/completions,
GET /v1/models, GET /v1/models/{id} (openai_api.py); POST /v1/responses, GET|DELETE /v1/responses/{id}
(responses_api.py); POST /tokenize (and /v1/tokenize), POST /detokenize (vLLM's answer), POST
/v1/detokenize (SGLang's), GET /tokenizer_info (tokenize_api.py); GET /load, POST /invocations (vllm_routes.py);
GET /version, GET /health (and /health_generate), GET /get_server_info
(and /server_info), GET /get_model_info (and /model_info), POST /flush_cache (GET is a 405: it
changes state), GET /metrics (here); POST /load_lora_adapter, POST /unload_lora_adapter (lora_api.py);
GET /get_load (router_api.py, with what sglang-router reads
from the info documents).
With `--api-key`, every route except /health, /health_generate and /metrics requires
`Authorization: Bearer <key>` (the scheme in any case; 401 otherwise), WebSocket handshakes
included. There is no WebSocket endpoint: a handshake is refused (after the key check) with a JSON
error, never upgraded. Every error body is `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.config import ServerArgs
from shared.messages import SchedulerInfo
from shared.model_info import ModelInfo
from tokenizer_proc.api.health import HealthProbe
from tokenizer_proc.api.lora_api import load_lora_endpoint, unload_lora_endpoint
from tokenizer_proc.api.native import generate_endpoint
from tokenizer_proc.api.openai_api import chat_endpoint, completions_endpoint, model_endpoint, models_endpoint
from tokenizer_proc.api.responses_api import response_endpoint, responses_endpoint
from tokenizer_proc.api.router_api import get_load, sglang_model_fields, sglang_server_fields
from tokenizer_proc.api.tokenize_api import (
    detokenize_endpoint,
    sglang_detokenize_endpoint,
    tokenize_endpoint,
    tokenizer_info_endpoint,
)
from tokenizer_proc.api.vllm_routes import ServerLoadMiddleware, invocations_endpoint, load_endpoint
from tokenizer_proc.context import AppContext, get_ctx
from tokenizer_proc.http.errors import ApiError, unavailable
from tokenizer_proc.http.plumbing import ClientGoneResponse, json_response
from tokenizer_proc.metrics import AdmissionSample, render_metrics
from tokenizer_proc.replicas.backend import ReplicatedBackend
from tokenizer_proc.requests.adapters import AdapterRegistry
from tokenizer_proc.requests.admission import Admission
from tokenizer_proc.requests.generation import Backend, BackendUnavailable
from tokenizer_proc.requests.images import ImageLoader
from tokenizer_proc.requests.latency import LatencyCollector
from tokenizer_proc.requests.response_store import ResponseStore
from tokenizer_proc.requests.tokenizer import ChatConventions, TextTokenizer
from tokenizer_proc.requests.validation import Limits, too_deep

logger = logging.getLogger(__name__)

PUBLIC_PATHS = frozenset({"/health", "/health_generate", "/metrics"})
VERSION = "0.1.0"


async def health(request: Request) -> Response:
    """200 {"status": "ok"} while a generation goes through. With --dp-size > 1 the body also has
    "degraded" (true while some replica is down), "replicas_up" and "dp_size": a server with any
    replica up still serves, and routers (sglang-router) keep a worker whose /health answers 200 in
    rotation and drop one answering 503, so 503 is kept for a server that cannot serve at all.
    While draining (SIGTERM) it is 503 {"status": "draining", "error": ...}, so routers stop sending;
    the drain is checked again after the probe, so no probe in flight when it began answers 200."""
    ctx = get_ctx(request)
    problem = None if ctx.admission.draining else await request.app.state.health.check()
    if ctx.admission.draining:
        err = unavailable("the server is shutting down (draining in-flight requests)")
        return json_response({"status": "draining", **err.body()}, 503)
    if problem is None:
        backend = ctx.backend
        detail = backend.health_detail() if isinstance(backend, ReplicatedBackend) else {}
        return json_response({"status": "ok", **detail})
    raise unavailable(f"the server is not healthy: {problem}")


async def _backend_info(ctx: AppContext) -> SchedulerInfo:
    try:
        return await ctx.backend.info()
    except (BackendUnavailable, TimeoutError) as e:
        raise unavailable(f"the scheduler did not answer: {e}") from e


async def server_info(request: Request) -> Response:
    """The server's config and state; "scheduler" is summed over the replicas with --dp-size > 1,
    and "replicas" lists each one (up or not, why not, load, routing counts, its own scheduler info)."""
    ctx = get_ctx(request)
    replicas: dict[str, Any] = {}
    if isinstance(ctx.backend, ReplicatedBackend):
        try:
            infos = await ctx.backend.replica_infos()
        except (BackendUnavailable, TimeoutError) as e:
            raise unavailable(f"the scheduler did not answer: {e}") from e
        info = ctx.backend.merged_info(infos)
        replicas = {"dp_size": len(ctx.backend.clients), "replicas": ctx.backend.replicas(infos)}
    else:
        info = await _backend_info(ctx)
    args = msgspec.to_builtins(ctx.args)
    if args.get("api_key"):
        args["api_key"] = "<redacted>"
    return json_response({
        **sglang_server_fields(ctx),
        "version": VERSION,
        "model_name": ctx.args.model_name,
        "context_length": ctx.limits.context_length,
        "vocab_size": ctx.limits.vocab_size,
        "healthy": ctx.backend.healthy,
        "server_args": args,
        "tokenizer": {"in_flight_requests": len(ctx.in_flight)},
        "lora_adapters": [msgspec.to_builtins(a) for a in ctx.adapters.adapters.values()],
        "scheduler": info,
        **replicas,
    })


async def version(request: Request) -> Response:
    """GET /version (vLLM, SGLang): this server's version."""
    return json_response({"version": VERSION})


async def model_info(request: Request) -> Response:
    ctx = get_ctx(request)
    return json_response({**sglang_model_fields(ctx), "model_name": ctx.args.model_name,
                          "is_generation": True, "context_length": ctx.limits.context_length})


async def flush_cache(request: Request) -> Response:
    ctx = get_ctx(request)
    await request.app.state.health.settle()  # this server's own /health probe is not a running request to refuse for
    flag = request.query_params.get("include_store", "false").lower()
    if flag not in ("true", "false", "1", "0"):
        raise ApiError(400, f"include_store must be true or false, got {flag!r}", param="include_store")
    try:
        ok, message = await ctx.backend.flush_cache(include_store=flag in ("true", "1"))
    except (BackendUnavailable, TimeoutError) as e:
        raise unavailable(f"the scheduler did not answer: {e}") from e
    if not ok:
        raise ApiError(400, f"cache not flushed: {message}", err_type="flush_failed")
    return json_response({"success": True, "message": message or "cache flushed"})


async def metrics(request: Request) -> Response:
    ctx = get_ctx(request)
    sched_metrics = None
    if ctx.backend.healthy:
        try:
            sched_metrics = (await ctx.backend.info()).metrics
        except (BackendUnavailable, TimeoutError) as e:
            logger.warning("/metrics without scheduler metrics: %s", e)
    admitted = len(ctx.in_flight)
    admission = AdmissionSample(ctx.admission.queued(admitted), dict(ctx.admission.refused))
    body = render_metrics(ctx.metrics, sched_metrics, admitted, ctx.backend.healthy,
                          LatencyCollector(ctx.latency), model_name=ctx.args.model_name,
                          admission=admission)  # fmt: skip
    return Response(body, media_type=CONTENT_TYPE_LATEST)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return ApiError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}").response()


async def _client_gone(request: Request, exc: Exception) -> Response:
    logger.debug("client disconnected while sending %s %s", request.method, request.url.path)
    return ClientGoneResponse()


async def _too_deep(request: Request, exc: Exception) -> Response:
    """Nested input that some step walks recursively (decode_body and the schema checks name the
    field themselves; this is the answer for any other such step): the request's fault."""
    logger.warning("%s %s: input nested too deeply (%s)", request.method, request.url.path, exc)
    return too_deep("the request").response()


async def _internal_error(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__}", err_type="server_error").response()


def _header(scope: Scope, wanted: bytes) -> bytes | None:
    for name, value in scope.get("headers", []):
        if name == wanted:
            return value
    return None


def _no_websocket() -> ApiError:
    return ApiError(400, "WebSocket is not supported: this server has no WebSocket endpoint (use HTTP and SSE)")


class ApiMiddleware:
    """Bearer-key check, WebSocket refusal and per-endpoint request counting (pure ASGI, so
    streaming is untouched). Rule: every scope but lifespan is checked for the key, so no
    handshake or request reaches a route without it."""

    def __init__(self, app: ASGIApp, ctx: AppContext, known_paths: frozenset[str]):
        self.app, self.ctx, self.known = app, ctx, known_paths
        self._key = ctx.args.api_key.encode() if ctx.args.api_key else None

    def _authorized(self, scope: Scope) -> bool:
        """`Authorization: Bearer <key>`; the scheme is case-insensitive (RFC 9110 §11.1)."""
        value = _header(scope, b"authorization")
        if value is None or self._key is None:
            return False
        scheme, _, token = value.strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)

    def _refusal(self, scope: Scope) -> ApiError | None:
        if self._key is not None and scope["path"] not in PUBLIC_PATHS and not self._authorized(scope):
            return ApiError(401, "missing or invalid API key (send Authorization: Bearer <key>)")
        upgrade = _header(scope, b"upgrade")
        if scope["type"] == "websocket" or (upgrade is not None and upgrade.strip().lower() == b"websocket"):
            return _no_websocket()
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await self._refuse_websocket(scope, send, self._refusal(scope) or _no_websocket())
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        status = [500]

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if (err := self._refusal(scope)) is not None:
                await err.response()(scope, receive, counting_send)
                return
            await self.app(scope, receive, counting_send)
        finally:
            self.ctx.metrics.record(path if path in self.known else "other", status[0])

    async def _refuse_websocket(self, scope: Scope, send: Send, err: ApiError) -> None:
        """A handshake that reached the app as a websocket scope (a server that upgrades; this one's
        protocol never does): the JSON error where the server can send a denial response, else a
        policy-violation close."""
        self.ctx.metrics.record(scope["path"] if scope["path"] in self.known else "other", err.status)
        if "websocket.http.response" in scope.get("extensions", {}):
            body = msgspec.json.encode(err.body())
            await send({"type": "websocket.http.response.start", "status": err.status,
                        "headers": [(b"content-type", b"application/json")]})  # fmt: skip
            await send({"type": "websocket.http.response.body", "body": body})
            return
        await send({"type": "websocket.close", "code": 1008, "reason": err.message[:120]})


def create_app(args: ServerArgs, backend: Backend, tokenizer: TextTokenizer | None = None) -> Starlette:
    """The HTTP app over `backend`. Loads the tokenizer from args.resolved_model_path unless given."""
    model_dir = args.resolved_model_path
    info = ModelInfo.from_dir(model_dir)
    tok = tokenizer or TextTokenizer.from_dir(model_dir, info, chat=ChatConventions.from_args(args))
    limits = Limits.from_args(args, info.max_position_embeddings, info.vocab_size, info.vision)
    ctx = AppContext(args, backend, tok, limits, responses=ResponseStore.from_args(args),
                     admission=Admission.from_args(args), images=ImageLoader.from_args(args, model_dir, info.vision),
                     adapters=AdapterRegistry.from_args(args))
    routes = [
        Route("/generate", generate_endpoint, methods=["POST"]),
        Route("/v1/completions", completions_endpoint, methods=["POST"]),
        Route("/v1/chat/completions", chat_endpoint, methods=["POST"]),
        Route("/v1/responses", responses_endpoint, methods=["POST"]),
        Route("/v1/responses/{response_id}", response_endpoint, methods=["GET", "DELETE"]),
        Route("/v1/models", models_endpoint, methods=["GET"]),
        Route("/v1/models/{model_id:path}", model_endpoint, methods=["GET"]),
        Route("/invocations", invocations_endpoint, methods=["POST"]),
        Route("/tokenize", tokenize_endpoint, methods=["POST"]),
        Route("/v1/tokenize", tokenize_endpoint, methods=["POST"]),
        Route("/detokenize", detokenize_endpoint, methods=["POST"]),
        Route("/v1/detokenize", sglang_detokenize_endpoint, methods=["POST"]),
        Route("/tokenizer_info", tokenizer_info_endpoint, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/server_info", server_info, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/model_info", model_info, methods=["GET"]),
        Route("/get_load", get_load, methods=["GET"]),
        Route("/load", load_endpoint, methods=["GET"]),
        Route("/flush_cache", flush_cache, methods=["POST"]),  # it changes state: never on GET
        Route("/load_lora_adapter", load_lora_endpoint, methods=["POST"]),
        Route("/unload_lora_adapter", unload_lora_endpoint, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    known = frozenset(r.path for r in routes)
    app = Starlette(
        routes=routes,
        middleware=[Middleware(ApiMiddleware, ctx=ctx, known_paths=known),  # type: ignore[arg-type]
                    Middleware(ServerLoadMiddleware, ctx=ctx)],  # type: ignore[arg-type]
        exception_handlers={
            ApiError: _api_error, HTTPException: _http_error, ClientDisconnect: _client_gone,
            RecursionError: _too_deep, Exception: _internal_error,
        },
    )
    app.state.ctx = ctx
    app.state.health = HealthProbe(backend)
    return app
