"""The backend protocol and the per-request generation driver shared by every endpoint.

`Backend` is what the HTTP layer needs from the scheduler side; `SchedulerClient` is the real
one, tests use fakes. `generate()` submits one prepared request, detokenises its TokenOuts and
yields `Piece`s; the endpoint modules only format them. Whatever way the consumer stops (normal
end, stop string, client disconnect, cancellation), a request that has not finished at the
scheduler is aborted there exactly once, in `generate()`'s `finally`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Protocol

from shared.messages import GenerateReq, LoraAdapter, SchedulerInfo, TokenOut
from tokenizer_proc.http.errors import bad_request
from tokenizer_proc.requests.detokenizer import IncrementalDetokenizer
from tokenizer_proc.requests.prepare import PreparedRequest
from tokenizer_proc.requests.stop_regex import StopRegexBudgetExceeded
from tokenizer_proc.requests.tokenizer import TextTokenizer


class BackendUnavailable(Exception):
    """The scheduler is gone (or not answering); the HTTP layer answers 503."""


class Backend(Protocol):
    """The scheduler, as seen by the HTTP layer. Implemented by SchedulerClient (zmq) and fakes."""

    @property
    def healthy(self) -> bool: ...

    def submit(self, req: GenerateReq) -> AsyncIterator[TokenOut]:
        """Send the request; iterate its TokenOuts up to and including the finished one.
        Raises BackendUnavailable when the scheduler is gone. The caller holds the rid's
        reservation in `InFlight`, so no two submissions of one rid are in flight at once."""
        ...

    def abort(self, rid: str, reason: str) -> None:
        """Tell the scheduler to drop `rid` and stop routing its outputs. Idempotent, never blocks."""
        ...

    async def wait_output(self) -> None:
        """Return when the scheduler next sends generated tokens (of any request)."""
        ...

    async def info(self) -> SchedulerInfo: ...

    async def flush_cache(self, include_store: bool = False) -> tuple[bool, str]: ...

    async def load_lora(self, adapter: LoraAdapter) -> tuple[bool, str]:
        """Register a checked adapter with the scheduler (every replica); (ok, why not)."""
        ...

    async def unload_lora(self, name: str) -> tuple[bool, str]:
        """Forget an adapter for new requests at the scheduler (every replica); (ok, why not)."""
        ...


@dataclass
class Finish:
    """Why a request ended. reason: "stop" | "length" | "abort" | "error" | "rejected" (the
    scheduler refused the request as one that can never run, or its output constraint left no token
    to sample: the client's fault, a 400)."""

    reason: str
    matched: int | str | None = None
    message: str | None = None
    param: str | None = None  # with "rejected": the request field at fault, when one is


@dataclass
class Piece:
    """New output of one request. `text` is safe (complete UTF-8, no stop-string prefix)."""

    text: str
    token_ids: list[int]
    logprobs: list[float | None] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish: Finish | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None  # alternatives of each of token_ids
    prompt_logprobs: list[float] | None = None  # prompt tokens 1.. (first piece only, when asked)
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_ranks: list[int] | None = None  # the rank of each of those prompt tokens (1 = the most likely)
    queue_s: float = -1.0  # seconds the request waited for admission (first piece with tokens; -1: not told)


class Reservation:
    """One request's hold on its rid in `InFlight` (compared by identity); `released` is set once
    the hold is dropped."""

    __slots__ = ("rid", "released")

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.released = asyncio.Event()


RID_SETTLE_S = 0.5
"""How long a request whose rid is held waits for that hold to go before it is refused (see InFlight)."""


@dataclass
class InFlight:
    """The rids this HTTP process has accepted and not yet answered; one per app.

    Rule: a rid is reserved (`reserve`) before the response starts, synchronously in the event
    loop, so of several concurrent requests with one rid exactly one is accepted and the others
    get a 400; `release` only drops the caller's own reservation (a later request may hold the
    rid again by then). A client that disconnects and at once reuses its rid races the server:
    the old request's hold goes only after the server has read that connection's end and
    cancelled it (a few event-loop turns later), so `settle` first waits up to RID_SETTLE_S for a
    held rid to be released; a rid still held then is refused with a message that says to retry."""

    rids: dict[str, Reservation] = field(default_factory=dict)
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set while no rid is held

    def __post_init__(self) -> None:
        self.idle.set()

    def reserve(self, rid: str) -> Reservation:
        if rid in self.rids:
            raise bad_request(f"a request with rid {rid!r} is already running (if its client has just "
                              "disconnected, retry in a moment)", "rid")  # fmt: skip
        hold = self.rids[rid] = Reservation(rid)
        self.idle.clear()
        return hold

    async def settle(self, rids: Sequence[str], timeout_s: float = RID_SETTLE_S) -> None:
        """Wait until none of `rids` is held, or at most `timeout_s` (then `reserve` decides)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        for rid in rids:
            while (hold := self.rids.get(rid)) is not None and (left := deadline - loop.time()) > 0:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(hold.released.wait(), left)

    def release(self, hold: Reservation) -> None:
        hold.released.set()
        if self.rids.get(hold.rid) is hold:
            del self.rids[hold.rid]
            if not self.rids:
                self.idle.set()

    def __len__(self) -> int:
        return len(self.rids)

    def check_integrity(self) -> None:
        assert all(isinstance(r, str) and r and h.rid == r for r, h in self.rids.items())


def _finish_of(out: TokenOut) -> Finish:
    reason = out.finish_reason or ("error" if out.error else "stop")
    if reason == "stop":
        return Finish("stop", matched=out.matched_stop_token)
    if reason == "error" and out.rejected:
        return Finish("rejected", message=out.error or "the request can never run on this server")
    if reason in ("abort", "error"):
        return Finish(reason, message=out.error or ("aborted" if reason == "abort" else "internal error"))
    return Finish(reason)


def precheck(backend: Backend, req: PreparedRequest, in_flight: InFlight) -> Reservation:
    """Every check made before a response starts (the only place they are made, so that a
    streaming request that cannot run gets a plain 4xx/503 instead of an error event): the
    backend is healthy (BackendUnavailable) and the rid is free in this process, which reserves
    it (ApiError 400 if it is taken). The caller releases the reservation when the response is
    over; `generate` releases it earlier, when the generation ends."""
    if not backend.healthy:
        raise BackendUnavailable("the scheduler is not available")
    return in_flight.reserve(req.rid)


async def generate(
    backend: Backend, tok: TextTokenizer, req: PreparedRequest, in_flight: InFlight, hold: Reservation,
    offload: Executor | None = None,
) -> AsyncGenerator[Piece, None]:
    """Run one request that passed `precheck` (`hold` reserves its rid); the last Piece has
    `finish` set. Before the first Piece it may raise BackendUnavailable (from `submit`). A request
    with stop_regex patterns detokenizes in `offload` (a thread pool; None: the loop's default), so its
    searches never hold the event loop; searches that pass their budget end it "rejected" (a 400)."""
    detok = tok.detokenizer(req.stops, req.skip_special_tokens, req.stop_regexes)
    msg = GenerateReq(rid=req.rid, input_ids=req.input_ids, sampling=req.sampling, priority=req.priority,
                      save_prompt_state=req.save_prompt_state, images=list(req.images), lora=req.lora)
    done, completion, cached = False, 0, 0
    try:
        async with contextlib.aclosing(backend.submit(msg)) as outs:  # type: ignore[type-var]
            async for out in outs:
                completion += len(out.token_ids)
                cached = max(cached, out.cached_tokens)
                try:
                    text, finish = await _detokenized(detok, out, offload)
                except StopRegexBudgetExceeded as e:
                    text, finish = "", Finish("rejected", message=str(e), param="stop_regex")
                if finish is not None and not out.finished:
                    backend.abort(req.rid, "stop string matched" if finish.reason == "stop" else finish.reason)
                logprobs = _aligned_logprobs(out) if req.sampling.logprobs else None
                done = finish is not None
                yield Piece(text, list(out.token_ids), logprobs, len(req.input_ids), completion, cached, finish,
                            out.top_logprobs, out.prompt_logprobs, out.prompt_top_logprobs, out.prompt_ranks,
                            out.queue_s)
                if done:
                    return
        done = True
        rest = "" if detok.searches else detok.finish()  # the request failed: no stop_regex search is worth it
        yield Piece(rest, [], None, len(req.input_ids), completion, cached,
                    Finish("error", message="the scheduler ended the request without a final output"))
    finally:
        in_flight.release(hold)
        if not done:
            backend.abort(req.rid, "client disconnected")


async def _detokenized(
    detok: IncrementalDetokenizer, out: TokenOut, offload: Executor | None
) -> tuple[str, Finish | None]:
    """(the text `out` makes safe, how the request finished if it did), in `offload` when the
    detokenizer searches stop_regex patterns."""
    if detok.searches:
        return await asyncio.get_running_loop().run_in_executor(offload, _detokenize, detok, out)
    return _detokenize(detok, out)


def _detokenize(detok: IncrementalDetokenizer, out: TokenOut) -> tuple[str, Finish | None]:
    text = detok.push(out.token_ids)
    if detok.matched_stop is not None:
        return text, Finish("stop", matched=detok.matched_stop)
    if not out.finished:
        return text, None
    text += detok.finish()
    # a stop string can only be decided at the end (a longer one starting earlier might still have
    # completed): it wins over the scheduler's reason
    stop = detok.matched_stop
    return text, Finish("stop", matched=stop) if stop is not None else _finish_of(out)


def _aligned_logprobs(out: TokenOut) -> list[float | None]:
    got = list(out.logprobs or [])
    return got[: len(out.token_ids)] + [None] * max(0, len(out.token_ids) - len(got))
