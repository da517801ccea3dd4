"""The channels between processes, each declared once: name, message union, socket types,
which side binds, and the endpoint.

All channels are PUSH -> PULL (ordered, no drops once connected). The receiving side binds,
except the scheduler -> worker channels where the scheduler binds one PUSH socket per rank so
that workers of other nodes can connect to node 0. Endpoints are `ipc://` under the launch's
run directory on one node and `tcp://` on node 0's address when `--nnodes > 1`. With
`--dp-size > 1` every channel but the one to launch.py exists once per replica: its ipc name
carries `-dp<D>` (ServerArgs.dp_rank), so each replica's scheduler and workers talk only to each
other, and the tokenizer holds one pair of scheduler channels per replica.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec
import zmq

from shared.config import ServerArgs
from shared.messages import ToLauncher, ToScheduler, ToSchedulerFromWorker, ToTokenizer, ToWorker

T = TypeVar("T")


class ChannelTimeout(TimeoutError):
    """A blocking receive waited longer than its timeout (the peer may be dead or hung)."""


@dataclass(frozen=True)
class Channel(Generic[T]):
    name: str
    msg_type: Any
    sender_binds: bool
    tcp_port_offset: int  # offset from the --dist-init-addr port for multi-node runs
    per_replica: bool = True  # one endpoint per --dp-size replica (all but the launcher's)

    def endpoint(self, args: ServerArgs, rank: int | None = None) -> str:
        suffix = f"{self.name}-dp{args.dp_rank}" if self.per_replica and args.dp_size > 1 else self.name
        if rank is not None:
            suffix = f"{suffix}-{rank}"
        if args.nnodes > 1 and self.name.startswith(("sched_to_worker", "worker_to_sched")):
            host, _, port = args.dist_init_addr.rpartition(":")
            return f"tcp://{host}:{int(port) + self.tcp_port_offset + (rank or 0)}"
        if not args.run_dir:
            raise ValueError("ServerArgs.run_dir must be set before opening channels")
        return f"ipc://{os.path.join(args.run_dir, suffix)}"


TOKENIZER_TO_SCHEDULER: Channel[ToScheduler] = Channel("tok_to_sched", ToScheduler, False, 0)
SCHEDULER_TO_TOKENIZER: Channel[ToTokenizer] = Channel("sched_to_tok", ToTokenizer, False, 0)
SCHEDULER_TO_WORKER: Channel[ToWorker] = Channel("sched_to_worker", ToWorker, True, 10)
WORKER_TO_SCHEDULER: Channel[ToSchedulerFromWorker] = Channel(
    "worker_to_sched", ToSchedulerFromWorker, False, 1
)
TO_LAUNCHER: Channel[ToLauncher] = Channel("to_launcher", ToLauncher, False, 0, per_replica=False)


class Sender(Generic[T]):
    """Owning wrapper of a PUSH socket. Not thread-safe: one thread sends."""

    def __init__(self, ctx: zmq.Context, channel: Channel[T], args: ServerArgs, rank: int | None = None):
        self.channel = channel
        self.sock = open_socket(ctx, zmq.PUSH, channel, args, rank, channel.sender_binds)
        self._enc = msgspec.msgpack.Encoder()

    def send(self, msg: T, timeout_ms: int = 10_000) -> None:
        self.send_encoded(self._enc.encode(msg), timeout_ms)

    def encode(self, msg: T) -> bytes:
        """Encode once for several senders of the same channel (one batch to every TP rank)."""
        return self._enc.encode(msg)

    def send_encoded(self, data: bytes, timeout_ms: int = 10_000) -> None:
        """Send bytes made by `encode` of a Sender of this same channel."""
        if not self.sock.poll(timeout_ms, zmq.POLLOUT):
            raise ChannelTimeout(f"{self.channel.name}: no receiver ready within {timeout_ms} ms")
        self.sock.send(data, copy=False)

    def close(self, linger_ms: int = 0) -> None:
        """LINGER 0 drops what is not yet transmitted; pass linger_ms > 0 after a last message
        that must arrive (a ready or failure report sent just before closing)."""
        self.sock.close(linger=linger_ms)


class Receiver(Generic[T]):
    """Owning wrapper of a PULL socket with typed decoding. Not thread-safe: one thread receives."""

    def __init__(self, ctx: zmq.Context, channel: Channel[T], args: ServerArgs, rank: int | None = None):
        self.channel = channel
        self.sock = open_socket(ctx, zmq.PULL, channel, args, rank, not channel.sender_binds)
        self._dec = msgspec.msgpack.Decoder(channel.msg_type)

    def decode(self, data: bytes | memoryview) -> T:
        return self._dec.decode(data)

    def recv(self, timeout_ms: int) -> T:
        """Block at most `timeout_ms`; raise ChannelTimeout when nothing arrived."""
        if not self.sock.poll(timeout_ms, zmq.POLLIN):
            raise ChannelTimeout(f"{self.channel.name}: nothing received within {timeout_ms} ms")
        return self._dec.decode(self.sock.recv(copy=False).buffer)

    def recv_spinning(self, spin_s: float, timeout_ms: int) -> T:
        """Poll without blocking for up to `spin_s`, then block at most `timeout_ms` (ChannelTimeout
        when nothing arrived). For a receiver whose next message usually follows within `spin_s`:
        it stays on its CPU instead of sleeping in the kernel and waking cold."""
        deadline = time.perf_counter() + spin_s
        while True:
            msg = self.recv_nowait()
            if msg is not None:
                return msg
            if time.perf_counter() >= deadline:
                return self.recv(timeout_ms)

    def recv_nowait(self) -> T | None:
        try:
            frame = self.sock.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        return self._dec.decode(frame.buffer)

    def drain(self, limit: int = 1 << 30) -> list[T]:
        out: list[T] = []
        while len(out) < limit:
            msg = self.recv_nowait()
            if msg is None:
                break
            out.append(msg)
        return out

    def close(self) -> None:
        self.sock.close(linger=0)


def open_socket(ctx: zmq.Context, kind: int, channel: Channel[Any], args: ServerArgs, rank: int | None,
                bind: bool) -> zmq.Socket:  # fmt: skip
    """A PUSH or PULL socket of `channel` (blocking or asyncio, as `ctx` is): LINGER 0, unbounded
    high-water mark, bound (on every interface for tcp) or connected to the channel's endpoint."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM if kind == zmq.PUSH else zmq.RCVHWM, 0)
    endpoint = channel.endpoint(args, rank)
    if bind:
        sock.bind(_bind_form(endpoint))
    else:
        sock.connect(endpoint)
    return sock


def _bind_form(endpoint: str) -> str:
    if endpoint.startswith("tcp://"):
        _, _, port = endpoint.rpartition(":")
        return f"tcp://*:{port}"
    return endpoint
