"""The children of one launch on this node and their supervision: start them, wait for each one's
readiness, watch them, stop them in order (docs/architecture.md, "Faults and supervision").

Owner: launch.py's `main` (in its main thread) and `hyssm.Engine` (from a supervisor thread,
hyssm/processes.py) each drive one `Launcher`. What must hold:
- every child is started from `node_processes` (shared/replicas.py) and reports ProcReady or
  ProcFailed on TO_LAUNCHER; start-up fails naming the first child that died, failed or lags;
- when a child dies the tokenizer is told (`SchedulerDead`: in-flight requests get a final error and
  /health turns 503), the rest are stopped and the launch ends non-zero; with --dp-size > 1 a death
  inside one replica stops only that replica while another is up (only its requests fail);
- a stop (SIGTERM/SIGINT, or FORWARD_SIGNAL from a child: shared/proc.py) is graceful: the tokenizer
  drains first (up to --graceful-shutdown-timeout), then schedulers and workers stop, each SIGKILLed
  after its grace period; a second SIGTERM/SIGINT sent to the launcher itself kills every child at once.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from multiprocessing.connection import wait
from typing import Any

import zmq

from shared.channels import SCHEDULER_TO_TOKENIZER, TO_LAUNCHER, ChannelTimeout, Receiver, Sender
from shared.child_process import ChildProcess
from shared.config import ServerArgs
from shared.errors import HyssmError
from shared.messages import ProcFailed, ProcReady, ProcStarting, SchedulerDead
from shared.proc import FORWARD_SIGNAL, STOP_SIGNAL
from shared.replicas import ReplicaSet, node_processes

logger = logging.getLogger(__name__)

_STARTUP_MARGIN_S = 5.0
_TOKENIZER_CLOSE_S = 5.0  # after its drain: answer the last clients, close connections and channels


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for rendezvous addresses this launch picks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launcher:
    """Owns every child process of this node and the run directory."""

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.ctx = zmq.Context()
        self.procs: dict[str, ChildProcess] = {}
        self.ready_rx: Receiver = Receiver(self.ctx, TO_LAUNCHER, args)
        self.stop_requested = False
        self.direct_signals = 0  # SIGTERM/SIGINT sent to launch.py itself (not forwarded by a child)
        self.forced = False  # a second one came: every child was killed
        self.replicas = ReplicaSet([])

    def start(self, addrs: list[str]) -> None:
        """Start every child of this node (shared/replicas.py); `addrs`: each replica's rendezvous address."""
        specs = node_processes(self.args, addrs)
        self.replicas = ReplicaSet(specs)
        for spec in specs:
            self.procs[spec.name] = ChildProcess(spec.kind, spec.args.to_bytes(), spec.rank, spec.name)
        for proc in self.procs.values():
            proc.start()

    def wait_ready(self) -> dict[str, Any]:
        """Block until every child reported ProcReady; raise StartupError naming the laggard."""
        pending = set(self.procs)
        info: dict[str, Any] = {}
        # Children enforce the start-up timeout themselves and report what they miss (the scheduler
        # names absent ranks and nodes); the launcher's own deadline comes a little later, counted from
        # the last word of a child still starting (ProcStarting).
        patience = self.args.startup_timeout + _STARTUP_MARGIN_S
        deadline = time.monotonic() + patience
        while pending:
            if self.stop_requested:
                raise HyssmError("interrupted during start-up")
            dead = [n for n, p in self.procs.items() if not p.is_alive()]
            if dead:
                raise HyssmError(f"{dead[0]} exited during start-up (code {self.procs[dead[0]].exitcode})")
            left = deadline - time.monotonic()
            if left <= 0:
                raise HyssmError(f"not ready within {self.args.startup_timeout:.0f}s: {', '.join(sorted(pending))}")
            try:
                msg = self.ready_rx.recv(int(min(left, 0.5) * 1000))
            except ChannelTimeout:
                continue
            if isinstance(msg, ProcFailed):
                raise HyssmError(f"{msg.name}: {msg.error}")
            if isinstance(msg, ProcReady):
                pending.discard(msg.name)
                info.update(msg.info)
            elif isinstance(msg, ProcStarting) and msg.name in pending:
                deadline = max(deadline, time.monotonic() + patience)
        return info

    def supervise(self) -> int:
        """Wait until a child dies (exit 1) or a stop signal arrives (exit 0). With --dp-size > 1 a
        death inside one replica takes down only that replica while another one is up."""
        sentinels = {p.sentinel: name for name, p in self.procs.items()}
        while not self.stop_requested:
            done = wait(list(sentinels), timeout=0.5)
            if self.stop_requested:  # a group signal: children may stop as it arrives
                break
            if done:
                name = sentinels.pop(done[0])
                self.procs[name].join(5.0)  # the sentinel closes before the exit status can be read
                code = self.procs[name].exitcode
                if code == 0 and self.args.node_rank > 0:  # told to stop by node 0's scheduler
                    logger.info("%s stopped: node 0 shut down", name)
                    self.shutdown("")
                    return 0
                failure = f"{name} exited unexpectedly (code {code})"
                if not self.replicas.ends_launch(name):
                    for stopped in self._replica_down(name, failure):
                        sentinels.pop(self.procs[stopped].sentinel, None)
                    continue
                if self.args.dp_size > 1 and name != "tokenizer":
                    failure += "; no replica is left"
                logger.error("%s; shutting down", failure)
                self.shutdown(failure)
                return 1
            self._drain_reports()
        self.shutdown("")
        return 1 if self.forced else 0

    def _replica_down(self, name: str, failure: str) -> list[str]:
        """Take down the replica of `name`: tell the tokenizer (its requests there end with an error,
        new ones go to the replicas up), stop its other processes. Returns their names."""
        d, others = self.replicas.take_down(name, failure)
        logger.error("%s: replica %d is down, %d replica(s) still serving", failure, d, len(self.replicas.up))
        self._tell_tokenizer(self.replicas.args_of(d), failure)
        self._stop(others)
        return others

    def _tell_tokenizer(self, args: ServerArgs, failure: str) -> None:
        tok = self.procs.get("tokenizer")
        if tok is None or not tok.is_alive():
            return
        try:
            tx = Sender(self.ctx, SCHEDULER_TO_TOKENIZER, args)
            tx.send(SchedulerDead(reason=failure), 1000)
            tx.close(linger_ms=1000)
        except ChannelTimeout:
            pass

    def _grace(self, name: str) -> float:
        """Seconds a stopping child gets before SIGKILL: the tokenizer its drain and close; a worker
        with a state store its queued writes (--graceful-shutdown-timeout); any other 3 s."""
        if name == "tokenizer":
            return self.args.graceful_shutdown_timeout + _TOKENIZER_CLOSE_S
        if name.startswith("worker") and self.args.state_store_enabled:
            return self.args.graceful_shutdown_timeout
        return 3.0

    def _stop(self, names: list[str]) -> None:
        """Stop `names` in order (tokenizer with SIGTERM, others with STOP_SIGNAL); SIGKILL what is
        still alive after its grace period: the tokenizer's is its drain (--graceful-shutdown-timeout)
        plus _TOKENIZER_CLOSE_S to close its connections."""
        for name in names:
            proc = self.procs[name]
            if proc.is_alive():
                if name == "tokenizer":
                    proc.terminate()
                elif proc.pid is not None:
                    os.kill(proc.pid, STOP_SIGNAL)
                proc.join(self._grace(name))
        for name in names:
            if self.procs[name].is_alive():
                self.procs[name].kill()
                self.procs[name].join(2.0)

    def _drain_reports(self) -> None:
        for msg in self.ready_rx.drain(16):
            if isinstance(msg, ProcFailed):
                logger.error("%s reported: %s", msg.name, msg.error)

    def shutdown(self, failure: str) -> None:
        """Tell the tokenizer (on failure, for every replica still up), then stop children: tokenizer
        first so clients get their answers, then schedulers and workers. Bounded: SIGKILL after the
        grace period."""
        if failure:
            for d in self.replicas.up:
                self._tell_tokenizer(self.replicas.args_of(d), failure)
        kinds = ("tokenizer", "scheduler", "worker")
        self._stop([n for kind in kinds for n in self.procs if n.startswith(kind)])
        for proc in self.procs.values():
            if not proc.is_alive():
                proc.close()
        self.ready_rx.close()
        self.ctx.term()

    def request_stop(self, signum: int, _frame: object) -> None:
        """SIGTERM/SIGINT (or FORWARD_SIGNAL from a child): shut down gracefully. A second SIGTERM or
        SIGINT sent to launch.py itself kills every child at once (exit 1); a child's forwarded
        signal never counts as a second one (a group SIGTERM reaches launch.py that way too)."""
        name = signal.Signals(signum).name
        if signum != FORWARD_SIGNAL:
            self.direct_signals += 1  # counted apart: Python may run a pending forward's handler first
        if self.direct_signals >= 2:
            if not self.forced:
                logger.warning("received %s again: stopping every process now", name)
                self.forced = True
                for proc in self.procs.values():
                    if proc.is_alive():
                        proc.kill()
            return
        if not self.stop_requested:
            logger.info("received %s, shutting down (in-flight requests get up to %g s)", name,
                        self.args.graceful_shutdown_timeout)  # fmt: skip
        self.stop_requested = True
