"""What every handler of one app shares: config, backend, tokenizer, limits, in-flight set, metrics, the
image loader of a checkpoint that sees.

One `AppContext` per app (created by `create_app`, stored at `app.state.ctx`); nothing global.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request

from shared.config import ServerArgs
from tokenizer_proc.metrics import HttpMetrics
from tokenizer_proc.requests.adapters import AdapterRegistry
from tokenizer_proc.requests.admission import Admission
from tokenizer_proc.requests.generation import Backend, InFlight
from tokenizer_proc.requests.images import ImageLoader
from tokenizer_proc.requests.latency import LatencyStats
from tokenizer_proc.requests.response_store import ResponseStore
from tokenizer_proc.requests.tokenizer import TextTokenizer
from tokenizer_proc.requests.validation import Limits, decode_body

B = TypeVar("B")
R = TypeVar("R")

# Bodies larger than this are tokenised in a worker thread so the event loop keeps streaming.
THREAD_TOKENIZE_BYTES = 64 * 1024
MATCHING_THREADS = 4  # requests whose stop_regex searches run at once (each bounded by its budget)


def _lowest_priority() -> None:
    """The calling thread runs at the lowest CPU priority (Linux schedules threads as tasks, each with
    its own nice value): a request's stop_regex searches never take a core from the model's steps or
    the event loop."""
    if sys.platform == "linux":
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def _matching_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(MATCHING_THREADS, thread_name_prefix="stop-regex", initializer=_lowest_priority)


@dataclass
class AppContext:
    args: ServerArgs
    backend: Backend
    tok: TextTokenizer
    limits: Limits
    in_flight: InFlight = field(default_factory=InFlight)
    admission: Admission = field(default_factory=lambda: Admission.from_args(ServerArgs()))  # create_app: from args
    metrics: HttpMetrics = field(default_factory=HttpMetrics)
    latency: LatencyStats = field(default_factory=LatencyStats)
    responses: ResponseStore = field(default_factory=lambda: ResponseStore.from_args(ServerArgs()))
    # the threads that detokenize requests with stop_regex patterns: their searches (GIL released, at
    # the lowest CPU priority) never hold the event loop, and they do not queue behind large bodies' tokenization
    matching: ThreadPoolExecutor = field(default_factory=_matching_pool)
    images: ImageLoader | None = None  # a checkpoint that sees: its image processor (requests/images.py)
    adapters: AdapterRegistry = field(default_factory=lambda: AdapterRegistry(ServerArgs()))  # create_app: args
    server_load: int = 0  # vLLM's /load: generation requests in flight (api/vllm_routes.ServerLoadMiddleware's)

    async def prepare(
        self, fn: Callable[[B, TextTokenizer, Limits], R], body: B, size: int, threaded: bool = False
    ) -> R:
        """fn(body, ...), in a worker thread for large bodies and when `threaded` (work that may
        block: grammar validation)."""
        return await self.offload(size, fn, body, self.tok, self.limits, threaded=threaded)

    async def offload(self, size: int, fn: Callable[..., R], *args: Any, threaded: bool = False) -> R:
        """fn(*args), in a worker thread when it reads a body of more than THREAD_TOKENIZE_BYTES
        (`size`) or when `threaded`: decoding, checking and tokenizing megabytes would hold the loop."""
        if size > THREAD_TOKENIZE_BYTES or threaded:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    async def decode(self, data: bytes, body_type: type[B]) -> B:
        """`data` decoded and checked as `body_type` (validation.decode_body), off the loop when large."""
        return await self.offload(len(data), decode_body, data, body_type)

    def check_integrity(self) -> None:
        self.in_flight.check_integrity()
        self.metrics.check_integrity()
        self.responses.check_integrity()
        self.adapters.check_integrity()
        assert self.server_load >= 0, self.server_load


def get_ctx(request: Request) -> AppContext:
    return request.app.state.ctx
