"""`SchedulerClient`: the real Backend, over the tokenizer <-> scheduler zmq channels.

It owns both sockets, the per-request output queues and ONE reader task that decodes every
ToTokenizer message and routes it: TokenOut by rid to that request's queue, InfoResp /
FlushCacheResp / LoraResp by req_id to the waiting future. `SchedulerDead` (or a broken channel) marks the
client unhealthy and finishes every in-flight request with an error, so no request hangs.

Rid reuse: a request aborted here before its final TokenOut arrived still gets that final reply
from the scheduler (exactly one per submission, after all its other outputs and before any
output of a later submission with the same rid). Until it arrives, every TokenOut of that rid is
the aborted request's and is dropped, so a client may reuse a rid as soon as it has its answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from shared.channels import SCHEDULER_TO_TOKENIZER, TOKENIZER_TO_SCHEDULER, ChannelTimeout
from shared.channels_async import AsyncReceiver, AsyncSender
from shared.config import ServerArgs
from shared.messages import (
    AbortReq,
    FlushCacheReq,
    FlushCacheResp,
    GenerateReq,
    GetInfoReq,
    InfoResp,
    LoadLoraReq,
    LoraAdapter,
    LoraResp,
    SchedulerDead,
    SchedulerInfo,
    TokenOut,
    TokenOutBatch,
    ToScheduler,
    ToTokenizer,
    UnloadLoraReq,
)
from tokenizer_proc.requests.generation import BackendUnavailable

logger = logging.getLogger(__name__)


class SchedulerClient:
    """Backend implementation. Create inside the event loop, `start()`, then `close()` last."""

    def __init__(self, zctx: zmq.asyncio.Context, args: ServerArgs, control_timeout_s: float = 10.0):
        self._rx: AsyncReceiver[ToTokenizer] = AsyncReceiver(zctx, SCHEDULER_TO_TOKENIZER, args)
        self._tx: AsyncSender[ToScheduler] = AsyncSender(zctx, TOKENIZER_TO_SCHEDULER, args)
        self._routes: dict[str, asyncio.Queue[TokenOut]] = {}
        self._owed: dict[str, int] = {}  # rid -> final replies still due for aborted submissions
        self._output_seen: asyncio.Event | None = None  # set (and dropped) when tokens next arrive
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._next_req_id = 0
        self._dead: str | None = None
        self._reader: asyncio.Task[None] | None = None
        self._timeout = control_timeout_s

    def start(self) -> None:
        self._reader = asyncio.get_running_loop().create_task(self._read_loop(), name="scheduler-reader")

    @property
    def healthy(self) -> bool:
        return self._dead is None and self._reader is not None and not self._reader.done()

    @property
    def dead_reason(self) -> str | None:
        """Why the scheduler is gone (None while it serves)."""
        return self._dead

    def _send(self, msg: ToScheduler) -> None:
        try:
            self._tx.send_nowait(msg)
        except ChannelTimeout as e:
            raise BackendUnavailable(str(e)) from e

    async def submit(self, req: GenerateReq) -> AsyncIterator[TokenOut]:
        if self._dead is not None:
            raise BackendUnavailable(self._dead)
        assert req.rid not in self._routes, "the caller's InFlight reservation keeps rids unique"
        queue: asyncio.Queue[TokenOut] = asyncio.Queue()
        self._routes[req.rid] = queue
        sent = False
        try:
            self._send(req)
            sent = True
            while True:
                out = await queue.get()
                yield out
                if out.finished:
                    return
        finally:
            if self._routes.get(req.rid) is queue:  # left before its final reply: it is still due
                del self._routes[req.rid]
                if sent and self._dead is None:
                    self._owed[req.rid] = self._owed.get(req.rid, 0) + 1

    def abort(self, rid: str, reason: str) -> None:
        if self._routes.pop(rid, None) is not None:
            self._owed[rid] = self._owed.get(rid, 0) + 1
        if self._dead is None:
            try:
                self._tx.send_nowait(AbortReq(rid=rid, reason=reason))
            except (ChannelTimeout, zmq.ZMQError) as e:
                logger.warning("could not send abort of %s: %s", rid, e)

    def abort_all(self, reason: str) -> int:
        """Shutdown: abort every in-flight request at the scheduler and finish it here with
        finish_reason "abort", so each client gets a final answer. Returns how many."""
        rids = list(self._routes)
        for rid in rids:
            self._routes[rid].put_nowait(
                TokenOut(rid=rid, token_ids=[], finished=True, finish_reason="abort", error=reason)
            )
            self.abort(rid, reason)
        return len(rids)

    async def _control(self, make: type[GetInfoReq | FlushCacheReq | LoadLoraReq | UnloadLoraReq],
                       **fields: Any) -> Any:  # fmt: skip
        if self._dead is not None:
            raise BackendUnavailable(self._dead)
        self._next_req_id += 1
        req_id = self._next_req_id
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[req_id] = fut
        try:
            self._send(make(req_id=req_id, **fields))
            return await asyncio.wait_for(fut, self._timeout)
        except asyncio.TimeoutError as e:
            raise TimeoutError(f"no answer from the scheduler within {self._timeout} s") from e
        finally:
            self._pending.pop(req_id, None)

    async def wait_output(self) -> None:
        if self._output_seen is None:
            self._output_seen = asyncio.Event()
        await self._output_seen.wait()

    async def info(self) -> SchedulerInfo:
        resp: InfoResp = await self._control(GetInfoReq)
        return resp.info

    async def flush_cache(self, include_store: bool = False) -> tuple[bool, str]:
        resp: FlushCacheResp = await self._control(FlushCacheReq, include_store=include_store)
        return resp.ok, resp.message

    async def load_lora(self, adapter: LoraAdapter) -> tuple[bool, str]:
        resp: LoraResp = await self._control(LoadLoraReq, adapter=adapter)
        return resp.ok, resp.message

    async def unload_lora(self, name: str) -> tuple[bool, str]:
        resp: LoraResp = await self._control(UnloadLoraReq, name=name)
        return resp.ok, resp.message

    async def _read_loop(self) -> None:
        try:
            while True:
                try:
                    self._dispatch(await self._rx.recv())
                    # whatever else is queued is taken now, without a future per message
                    while (msg := self._rx.recv_nowait()) is not None:
                        self._dispatch(msg)
                except msgspec.ValidationError as e:
                    logger.error("dropping a malformed message from the scheduler: %s", e)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure here means the scheduler is unreachable
            logger.exception("scheduler channel failed")
            self._fail(f"scheduler channel failed: {e}")

    def _dispatch(self, msg: ToTokenizer) -> None:
        if isinstance(msg, TokenOutBatch):
            if self._output_seen is not None and any(out.token_ids for out in msg.outs):
                self._output_seen.set()
                self._output_seen = None
            for out in msg.outs:
                if out.rid in self._owed:
                    if out.finished:
                        self._release_owed(out.rid)
                    continue  # an aborted submission's output
                queue = self._routes.get(out.rid)
                if queue is None:
                    continue  # aborted here already, or not ours
                queue.put_nowait(out)
                if out.finished:
                    del self._routes[out.rid]
        elif isinstance(msg, (InfoResp, FlushCacheResp, LoraResp)):
            fut = self._pending.get(msg.req_id)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, SchedulerDead):
            logger.error("scheduler is dead: %s", msg.reason)
            self._fail(msg.reason)

    def _release_owed(self, rid: str) -> None:
        left = self._owed.pop(rid) - 1
        if left:
            self._owed[rid] = left

    def _fail(self, reason: str) -> None:
        """Unhealthy from now on; every in-flight request and control call ends with an error."""
        self._dead = reason or "the scheduler is gone"
        for rid, queue in self._routes.items():
            queue.put_nowait(TokenOut(rid=rid, token_ids=[], finished=True, finish_reason="error",
                                      error=f"server error: {self._dead}"))
        self._routes.clear()
        self._owed.clear()
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(BackendUnavailable(self._dead))
        self._pending.clear()

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self._rx.close()
        # a short linger so that aborts queued just before shutdown still reach the scheduler
        self._tx.close(linger_ms=500)

    def in_flight(self) -> int:
        return len(self._routes)

    def check_integrity(self) -> None:
        if self._dead is not None:
            assert not self._routes and not self._pending and not self._owed, "state kept after the scheduler died"
        assert all(n > 0 for n in self._owed.values()), "an owed count is not positive"
        assert all(not f.done() for f in self._pending.values()), "a finished control future was kept"
