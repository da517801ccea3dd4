"""asyncio variants of `shared.channels.Sender` / `Receiver`, over `zmq.asyncio`.

Same channel declarations, socket types, bind/connect sides, LINGER 0 and unbounded HWM as the
blocking versions; used by processes that run an event loop (the tokenizer's HTTP server).
Each wrapper owns its socket; one task sends (or receives) on it at a time.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import msgspec
import zmq
import zmq.asyncio

from shared.channels import Channel, ChannelTimeout, open_socket
from shared.config import ServerArgs

T = TypeVar("T")


class AsyncSender(Generic[T]):
    """Owning wrapper of a PUSH socket on an asyncio context."""

    def __init__(self, ctx: zmq.asyncio.Context, channel: Channel[T], args: ServerArgs,
                 rank: int | None = None):
        self.channel = channel
        self.sock: zmq.asyncio.Socket = open_socket(ctx, zmq.PUSH, channel, args, rank, channel.sender_binds)
        self._enc = msgspec.msgpack.Encoder()

    async def send(self, msg: T, timeout_s: float = 10.0) -> None:
        """Wait at most `timeout_s` for the socket to accept the message; ChannelTimeout otherwise."""
        data = self._enc.encode(msg)
        if not await self.sock.poll(int(timeout_s * 1000), zmq.POLLOUT):
            raise ChannelTimeout(f"{self.channel.name}: no receiver ready within {timeout_s} s")
        await self.sock.send(data, copy=False)

    def send_nowait(self, msg: T) -> None:
        """Queue the message without waiting (synchronous; safe in `finally` and callbacks).

        With SNDHWM 0 a connected PUSH socket always has room, so this only fails (ChannelTimeout)
        when no peer pipe exists at all (a binding sender with nobody connected)."""
        # a NOBLOCK send on a zmq.asyncio socket returns an already-resolved future
        fut = self.sock.send(self._enc.encode(msg), zmq.NOBLOCK, copy=False)
        try:
            fut.result()
        except zmq.Again as e:
            raise ChannelTimeout(f"{self.channel.name}: no receiver to queue for") from e

    def close(self, linger_ms: int = 0) -> None:
        """As Sender.close: pass linger_ms > 0 when the last messages must still arrive."""
        self.sock.close(linger=linger_ms)


class AsyncReceiver(Generic[T]):
    """Owning wrapper of a PULL socket on an asyncio context, with typed decoding."""

    def __init__(self, ctx: zmq.asyncio.Context, channel: Channel[T], args: ServerArgs,
                 rank: int | None = None):
        self.channel = channel
        self.sock: zmq.asyncio.Socket = open_socket(ctx, zmq.PULL, channel, args, rank, not channel.sender_binds)
        self._dec = msgspec.msgpack.Decoder(channel.msg_type)

    def decode(self, data: bytes | memoryview) -> T:
        return self._dec.decode(data)

    async def recv(self, timeout_s: float | None = None) -> T:
        """Wait for one message; with a timeout, raise ChannelTimeout when nothing arrived.
        A message of the wrong shape raises msgspec.ValidationError."""
        if timeout_s is not None:
            if not await self.sock.poll(int(timeout_s * 1000), zmq.POLLIN):
                raise ChannelTimeout(f"{self.channel.name}: nothing received within {timeout_s} s")
        frame = await self.sock.recv(copy=False)  # without a timeout: one future, no poll before it
        return self._dec.decode(frame.buffer)

    def recv_nowait(self) -> T | None:
        fut = self.sock.recv(zmq.NOBLOCK, copy=False)  # resolved at once: a frame or zmq.Again
        try:
            frame = fut.result()
        except zmq.Again:
            return None
        return self._dec.decode(frame.buffer)

    def close(self) -> None:
        self.sock.close(linger=0)
