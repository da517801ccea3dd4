"""A worker rank's word while it starts: until it is ready, a thread of its own tells the scheduler
(`WorkerStarting`) and this node's launcher (`ProcStarting`) about once a second that the rank is alive
and in which phase, so that both count --startup-timeout from the rank's last word and not from the
launch: a first start that compiles the kernels, loads a large checkpoint and measures its execution
plan may take minutes, while a rank that never came or died is still reported after the timeout.

Owns: its thread and that thread's two sockets (ZeroMQ sockets are used by one thread each). The
main thread only sets `phase`; `stop()` joins the thread before the rank sends WorkerReady on its
own socket, so no word of the beacon follows the rank's ready message from this process.
"""

from __future__ import annotations

import logging
import threading
import time

import zmq

from shared.channels import TO_LAUNCHER, WORKER_TO_SCHEDULER, ChannelTimeout, Sender
from shared.config import ServerArgs
from shared.messages import ProcStarting, WorkerStarting

logger = logging.getLogger(__name__)

BEACON_INTERVAL_S = 1.0
"""How often a starting rank gives word; well under any sensible --startup-timeout."""


class StartupBeacon:
    """One per starting rank; `start()` once, `stop()` once (idempotent), before WorkerReady is sent."""

    def __init__(self, ctx: zmq.Context, args: ServerArgs, rank: int) -> None:
        self.ctx = ctx
        self.args = args
        self.rank = rank
        self.name = args.proc_name("worker", rank)
        self.phase = "starting"
        self._started_at = time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"startup-beacon-{rank}", daemon=True)
        self.sent = 0  # words given (both sockets), for tests

    def start(self) -> StartupBeacon:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        to_scheduler: Sender = Sender(self.ctx, WORKER_TO_SCHEDULER, self.args)
        to_launcher: Sender = Sender(self.ctx, TO_LAUNCHER, self.args)
        try:
            while not self._done.wait(BEACON_INTERVAL_S):
                elapsed = time.monotonic() - self._started_at
                phase = self.phase
                for sender, msg in ((to_scheduler, WorkerStarting(rank=self.rank, phase=phase, elapsed_s=elapsed)),
                                    (to_launcher, ProcStarting(name=self.name, phase=phase))):
                    try:
                        sender.send(msg, 0)  # a receiver not there yet misses this word, not the next
                        self.sent += 1
                    except ChannelTimeout:
                        pass
        finally:
            to_scheduler.close()
            to_launcher.close()

    def check_integrity(self) -> None:
        assert self.sent >= 0
        assert self._done.is_set() or self._thread.is_alive() or self._thread.ident is None
