"""`Receiver.recv_spinning`, the worker's wait for its next batch (real zmq sockets over ipc): it
returns a message that arrives while it polls, one that arrives after it has gone to block, and
raises ChannelTimeout only after both its spin and its timeout have passed."""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from shared.channels import SCHEDULER_TO_WORKER, ChannelTimeout, Receiver, Sender
from shared.config import ServerArgs
from shared.messages import Heartbeat, Shutdown

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pair() -> Iterator[tuple[Receiver, Sender]]:
    with tempfile.TemporaryDirectory(prefix="hyssm-s-") as d:  # short path: ipc names are length-limited
        args = ServerArgs(run_dir=d)
        ctx = zmq.Context()
        rx = Receiver(ctx, SCHEDULER_TO_WORKER, args, 0)
        tx = Sender(ctx, SCHEDULER_TO_WORKER, args, 0)
        try:
            yield rx, tx
        finally:
            rx.close()
            tx.close()
            ctx.destroy(linger=0)


def test_a_message_arriving_during_the_spin_returns_at_once(pair: tuple[Receiver, Sender]) -> None:
    rx, tx = pair
    tx.send(Heartbeat())
    assert rx.recv_spinning(0.5, 5000) == Heartbeat()  # already queued
    sender = threading.Thread(target=tx.send, args=(Shutdown(reason="done"),))
    t0 = time.perf_counter()
    sender.start()
    assert rx.recv_spinning(30.0, 5000) == Shutdown(reason="done")
    assert time.perf_counter() - t0 < 15.0  # not held to the end of the spin
    sender.join()


def test_after_the_spin_it_blocks_then_times_out(pair: tuple[Receiver, Sender]) -> None:
    rx, tx = pair
    sender = threading.Thread(target=tx.send, args=(Heartbeat(),))
    sender.start()
    assert rx.recv_spinning(0.0, 10_000) == Heartbeat()  # no spin: found at once or in the blocking poll
    sender.join()
    t0 = time.perf_counter()
    with pytest.raises(ChannelTimeout):
        rx.recv_spinning(0.05, 50)
    assert time.perf_counter() - t0 >= 0.09  # the spin, then the timeout
