"""shared/channels_async.py and SchedulerClient against a scripted scheduler peer (real zmq
sockets over ipc in a temp run dir; the peer uses the blocking shared.channels wrappers)."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Awaitable, Callable, Iterator

import msgspec
import pytest
import zmq
import zmq.asyncio

from shared.channels import SCHEDULER_TO_TOKENIZER, TOKENIZER_TO_SCHEDULER, ChannelTimeout, Receiver, Sender
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
    MetricRecord,
    SamplingParams,
    SchedulerDead,
    SchedulerInfo,
    ServerState,
    TokenOut,
    TokenOutBatch,
    UnloadLoraReq,
)
from tokenizer_proc.replicas.scheduler_client import SchedulerClient
from tokenizer_proc.requests.generation import BackendUnavailable


@pytest.fixture
def run_args() -> Iterator[ServerArgs]:
    with tempfile.TemporaryDirectory(prefix="hyssm-t-") as d:  # short path: ipc names are length-limited
        yield ServerArgs(run_dir=d)


async def _recv(rx: Receiver, timeout_s: float = 5.0):  # the blocking peer, polled from the loop
    return await asyncio.to_thread(rx.recv, int(timeout_s * 1000))


def _with_peer(args: ServerArgs, body: Callable[[SchedulerClient, Receiver, Sender], Awaitable[None]]) -> None:
    """Run `body(client, peer_rx, peer_tx)`: peer_rx gets what the client sends, peer_tx talks back."""
    async def main() -> None:
        zctx = zmq.asyncio.Context()
        sctx = zmq.Context()
        peer_rx = Receiver(sctx, TOKENIZER_TO_SCHEDULER, args)
        client = SchedulerClient(zctx, args, control_timeout_s=0.3)
        peer_tx = Sender(sctx, SCHEDULER_TO_TOKENIZER, args)
        client.start()
        try:
            await body(client, peer_rx, peer_tx)
            client.check_integrity()
        finally:
            await client.close()
            peer_rx.close()
            peer_tx.close()
            zctx.destroy(linger=0)
            sctx.destroy(linger=0)

    asyncio.run(asyncio.wait_for(main(), 30))


def _req(rid: str) -> GenerateReq:
    return GenerateReq(rid=rid, input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=3))


def test_async_channels_round_trip_and_timeouts(run_args: ServerArgs) -> None:
    async def main() -> None:
        zctx = zmq.asyncio.Context()
        rx = AsyncReceiver(zctx, TOKENIZER_TO_SCHEDULER, run_args)
        tx = AsyncSender(zctx, TOKENIZER_TO_SCHEDULER, run_args)
        try:
            with pytest.raises(ChannelTimeout):
                await rx.recv(timeout_s=0.05)
            assert rx.recv_nowait() is None
            await tx.send(_req("a"))
            tx.send_nowait(AbortReq(rid="a"))
            assert await rx.recv(timeout_s=5) == _req("a")
            assert await rx.recv(timeout_s=5) == AbortReq(rid="a")
            # typed decoding: a message of another channel's type is an error, not accepted
            with pytest.raises(msgspec.ValidationError):
                rx.decode(msgspec.msgpack.encode(SchedulerDead(reason="x")))
        finally:
            rx.close()
            tx.close()
            zctx.destroy(linger=0)

    asyncio.run(asyncio.wait_for(main(), 30))


def test_outputs_routed_by_rid_and_abort(run_args: ServerArgs) -> None:
    async def body(client: SchedulerClient, peer_rx: Receiver, peer_tx: Sender) -> None:
        it_a = client.submit(_req("a"))
        it_b = client.submit(_req("b"))
        first_a = asyncio.ensure_future(it_a.__anext__())
        first_b = asyncio.ensure_future(it_b.__anext__())
        got = {(await _recv(peer_rx)).rid, (await _recv(peer_rx)).rid}
        assert got == {"a", "b"}
        peer_tx.send(TokenOutBatch(outs=[TokenOut(rid="b", token_ids=[7]), TokenOut(rid="a", token_ids=[5, 6]),
                                         TokenOut(rid="zzz", token_ids=[1])]))
        assert (await first_a).token_ids == [5, 6]
        assert (await first_b).token_ids == [7]
        peer_tx.send(TokenOutBatch(outs=[TokenOut(rid="a", token_ids=[8], finished=True, finish_reason="length")]))
        last = await it_a.__anext__()
        assert last.finished and last.token_ids == [8]
        with pytest.raises(StopAsyncIteration):
            await it_a.__anext__()
        client.abort("b", "client disconnected")
        assert await _recv(peer_rx) == AbortReq(rid="b", reason="client disconnected")
        await it_b.aclose()
        assert client.in_flight() == 0

    _with_peer(run_args, body)


def test_info_and_flush_answered_by_req_id(run_args: ServerArgs) -> None:
    async def body(client: SchedulerClient, peer_rx: Receiver, peer_tx: Sender) -> None:
        info = asyncio.ensure_future(client.info())
        flush = asyncio.ensure_future(client.flush_cache())
        reqs = [await _recv(peer_rx), await _recv(peer_rx)]
        by_type = {type(r): r for r in reqs}
        peer_tx.send(FlushCacheResp(req_id=by_type[FlushCacheReq].req_id, ok=False, message="busy"))
        doc = SchedulerInfo(server=ServerState(num_running=2), metrics=[
            MetricRecord(name="hyssm_x_total", type="counter", help="x", labels={"k": "v"}, value=3)])
        peer_tx.send(InfoResp(req_id=by_type[GetInfoReq].req_id, info=doc))
        assert await info == doc
        assert await flush == (False, "busy")
        with pytest.raises(TimeoutError):
            await client.info()  # nobody answers this one
        assert isinstance(await _recv(peer_rx), GetInfoReq)

    _with_peer(run_args, body)


def test_lora_loads_and_unloads_answered_by_req_id(run_args: ServerArgs) -> None:
    adapter = LoraAdapter(name="sql", path="/a/sql", uid="u1", rank=8, scaling=2.0, targets=("q_proj",))

    async def body(client: SchedulerClient, peer_rx: Receiver, peer_tx: Sender) -> None:
        load = asyncio.ensure_future(client.load_lora(adapter))
        unload = asyncio.ensure_future(client.unload_lora("chat"))
        reqs = {type(r): r for r in [await _recv(peer_rx), await _recv(peer_rx)]}
        assert reqs[LoadLoraReq].adapter == adapter and reqs[UnloadLoraReq].name == "chat"
        peer_tx.send(LoraResp(req_id=reqs[UnloadLoraReq].req_id, ok=False, message="not loaded"))
        peer_tx.send(LoraResp(req_id=reqs[LoadLoraReq].req_id, ok=True))
        assert await load == (True, "")
        assert await unload == (False, "not loaded")

    _with_peer(run_args, body)


def test_scheduler_dead_finishes_everything_with_an_error(run_args: ServerArgs) -> None:
    async def body(client: SchedulerClient, peer_rx: Receiver, peer_tx: Sender) -> None:
        its = [client.submit(_req(f"r{i}")) for i in range(3)]
        firsts = [asyncio.ensure_future(it.__anext__()) for it in its]
        for _ in its:
            await _recv(peer_rx)
        info = asyncio.ensure_future(client.info())
        await _recv(peer_rx)
        assert client.healthy
        peer_tx.send(SchedulerDead(reason="worker-tp0 exited unexpectedly"))
        outs = [await f for f in firsts]
        assert all(o.finished and o.finish_reason == "error" and "worker-tp0" in (o.error or "") for o in outs)
        with pytest.raises(BackendUnavailable):
            await info
        assert not client.healthy
        with pytest.raises(BackendUnavailable):
            await client.submit(_req("late")).__anext__()
        for it in its:
            await it.aclose()

    _with_peer(run_args, body)


def test_malformed_message_is_dropped_not_fatal(run_args: ServerArgs) -> None:
    async def body(client: SchedulerClient, peer_rx: Receiver, peer_tx: Sender) -> None:
        it = client.submit(_req("a"))
        first = asyncio.ensure_future(it.__anext__())
        await _recv(peer_rx)
        peer_tx.sock.send(msgspec.msgpack.encode({"type": "Nonsense"}))
        peer_tx.send(TokenOutBatch(outs=[TokenOut(rid="a", token_ids=[1], finished=True, finish_reason="stop")]))
        assert (await first).finished
        assert client.healthy
        await it.aclose()

    _with_peer(run_args, body)


def test_abort_all_answers_every_request_and_tells_the_scheduler(run_args: ServerArgs) -> None:
    async def body(client: SchedulerClient, peer_rx: Receiver, peer_tx: Sender) -> None:
        its = [client.submit(_req(f"r{i}")) for i in range(2)]
        firsts = [asyncio.ensure_future(it.__anext__()) for it in its]
        for _ in its:
            await _recv(peer_rx)
        assert client.abort_all("server shutting down") == 2
        outs = [await f for f in firsts]
        assert all(o.finished and o.finish_reason == "abort" for o in outs)
        aborts = {(await _recv(peer_rx)).rid for _ in its}
        assert aborts == {"r0", "r1"} and client.in_flight() == 0
        for it in its:
            await it.aclose()

    _with_peer(run_args, body)
