"""The scheduler process: the ZeroMQ event loop around `Scheduler` (pure logic).

Owns: the sockets to the tokenizer and to every worker rank, the in-flight batch (at most one),
and the watchdog on the workers' reply. Everything about requests, slots and the cache lives in
`Scheduler`, which this loop calls from one thread only.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import dataclass

import msgspec
import zmq

from scheduler_proc.scheduler import Scheduler
from scheduler_proc.store_tier import StoreTier
from shared.channels import (
    SCHEDULER_TO_TOKENIZER,
    SCHEDULER_TO_WORKER,
    TO_LAUNCHER,
    TOKENIZER_TO_SCHEDULER,
    WORKER_TO_SCHEDULER,
    ChannelTimeout,
    Receiver,
    Sender,
)
from shared.config import ServerArgs
from shared.errors import StartupError
from shared.lora_paths import startup_adapters
from shared.messages import (
    AbortReq,
    FlushCacheReq,
    FlushCacheResp,
    ForwardBatch,
    GenerateReq,
    GetInfoReq,
    Heartbeat,
    InfoResp,
    LoadLoraReq,
    LoopInfo,
    LoraResp,
    ProcReady,
    SchedulerInfo,
    Shutdown,
    StepResult,
    TokenOut,
    TokenOutBatch,
    UnloadLoraReq,
    WorkerReady,
    WorkerStarting,
)
from shared.model_info import ModelInfo
from shared.proc import STOP_SIGNAL
from shared.state_store import StoreError, StoreNamespace
from shared.state_store.backends import open_probe

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 1000  # no work: the poll only bounds the heartbeat interval
_IN_FLIGHT_POLL_MS = 100  # a batch is out: the watchdog is checked at least this often
_BLOCKED_POLL_MS = 50  # work waits but no batch could be built: try again at least this often
_HEARTBEAT_S = 1.0


@dataclass
class LoopStats:
    """Where the wall time of served steps goes, as the loop sees it. One per SchedulerLoop,
    reported as SchedulerInfo.loop. Per step: `round_trip` = batch sent -> its StepResult
    received, `worker` = the workers' own step time (StepResult.elapsed_s); their difference is
    transport, message encode/decode and waiting for a CPU. `turnaround` = StepResult received ->
    next batch sent, counted when the next batch follows at once (the loop's own share)."""

    steps: int = 0
    round_trip_s: float = 0.0
    worker_s: float = 0.0
    turnarounds: int = 0
    turnaround_s: float = 0.0

    def on_result(self, round_trip_s: float, worker_s: float) -> None:
        self.steps += 1
        self.round_trip_s += round_trip_s
        self.worker_s += worker_s

    def on_turnaround(self, seconds: float) -> None:
        self.turnarounds += 1
        self.turnaround_s += seconds

    def info(self) -> LoopInfo:
        def mean_ms(total: float, n: int) -> float:
            return 1000.0 * total / n if n else 0.0

        return LoopInfo(
            steps=self.steps,
            worker_ms_mean=mean_ms(self.worker_s, self.steps),
            round_trip_ms_mean=mean_ms(self.round_trip_s, self.steps),
            outside_worker_ms_mean=mean_ms(self.round_trip_s - self.worker_s, self.steps),
            turnaround_ms_mean=mean_ms(self.turnaround_s, self.turnarounds),
        )

    def check_integrity(self) -> None:
        assert 0 <= self.turnarounds <= self.steps
        assert min(self.round_trip_s, self.worker_s, self.turnaround_s) >= 0.0


class SchedulerLoop:
    """One round = drain requests, send one batch to every rank, wait for rank 0's StepResult
    (serving requests meanwhile), apply it, then at once drain requests and send the next batch,
    and only then send the applied step's outputs. Single-threaded.

    Rule: between a StepResult arriving and the next batch leaving, the loop does only what the
    next batch depends on (apply the result, take queued requests and aborts, schedule). Sending
    TokenOuts wakes the tokenizer process, which competes for the CPU; it comes after the send."""

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.ctx = zmq.Context()
        self.from_tok: Receiver = Receiver(self.ctx, TOKENIZER_TO_SCHEDULER, args)
        self.from_workers: Receiver = Receiver(self.ctx, WORKER_TO_SCHEDULER, args)
        self.to_workers = [Sender(self.ctx, SCHEDULER_TO_WORKER, args, rank) for rank in range(args.tp_size)]
        self.to_tok: Sender = Sender(self.ctx, SCHEDULER_TO_TOKENIZER, args)
        self.poller = zmq.Poller()
        self.poller.register(self.from_tok.sock, zmq.POLLIN)
        self.poller.register(self.from_workers.sock, zmq.POLLIN)
        self.sched: Scheduler | None = None
        self.in_flight: ForwardBatch | None = None
        self.in_flight_since = 0.0
        self.last_sent = 0.0
        self.stats = LoopStats()
        self._sent_at = 0.0  # perf_counter() when the in-flight batch left
        self._result_at: float | None = None  # perf_counter() when a StepResult was applied this round
        self._store_clear_waiters: list[int] = []  # flushes with include_store not yet sent to the workers
        self._store_clearing: list[int] = []  # those whose batch (store_clear) is in flight

    def wait_for_workers(self) -> tuple[dict[str, int], str]:
        """Collect WorkerReady from every rank; capacities are the minimum across ranks. Also rank 0's
        state store namespace ("" without a store). A rank fails the start when --startup-timeout passes
        without a word from it: since the start, or since its last WorkerStarting."""
        ready: dict[int, WorkerReady] = {}
        started = time.monotonic()
        heard: dict[int, float] = {}  # a starting rank's last word (WorkerStarting)
        while len(ready) < self.args.tp_size:
            now = time.monotonic()
            waiting = [r for r in range(self.args.tp_size) if r not in ready]
            silent = [r for r in waiting if now - heard.get(r, started) > self.args.startup_timeout]
            if silent:
                nodes = sorted({r // self.args.ranks_per_node for r in silent})
                raise StartupError(f"worker ranks {silent} (nodes {nodes}) did not report ready in time "
                                   f"(no word for {self.args.startup_timeout:.0f}s)")
            try:
                msg = self.from_workers.recv(1000)
            except ChannelTimeout:
                continue
            if isinstance(msg, WorkerReady):
                ready[msg.rank] = msg
            elif isinstance(msg, WorkerStarting) and msg.rank not in ready:
                heard[msg.rank] = time.monotonic()
        kv = min(r.kv_slots for r in ready.values())
        mamba = min(r.state_slots for r in ready.values())
        return {"kv_capacity": kv, "state_capacity": mamba}, ready[0].store_namespace

    def start(self) -> None:
        caps, namespace = self.wait_for_workers()
        model = ModelInfo.from_dir(self.args.resolved_model_path)
        store = open_store_tier(self.args, model, namespace) if namespace else None
        self.sched = Scheduler(self.args, model, caps["kv_capacity"], caps["state_capacity"], store=store)
        for adapter in startup_adapters(self.args):  # the tokenizer reads the same ones (shared/lora_paths.py)
            if error := self.sched.lora.load(adapter):
                raise StartupError(error)
        logger.info("scheduler ready: %s", caps)
        tx = Sender(self.ctx, TO_LAUNCHER, self.args)
        tx.send(ProcReady(name=self.args.proc_name("scheduler"), info=caps))
        tx.close(linger_ms=2000)

    # ------------------------------------------------------------------ loop
    def run_forever(self) -> None:
        while True:
            self.run_once()

    def run_once(self) -> None:
        """Wait for a message (or the poll timeout), then act on it. When no batch is in flight
        (the StepResult was just applied, or the loop is idle), take queued requests and
        dispatch the next batch BEFORE sending any TokenOut."""
        assert self.sched is not None
        events = dict(self.poller.poll(self._poll_timeout_ms()))
        outs: list[TokenOut] = []
        if self.from_workers.sock in events:
            outs = self._handle_worker_msgs()
        if self.in_flight is None:
            outs += self._handle_requests()
            self._schedule_and_dispatch()
            self._result_at = None
        elif self.from_tok.sock in events:
            outs += self._handle_requests()
        self._send_outs(outs)
        self._check_watchdog()
        self._heartbeat()

    def _poll_timeout_ms(self) -> int:
        """Idle means no batch could be built from the current state, and only a message (a new
        request, an abort) changes that; a bounded wait instead of the old 0 ms busy poll."""
        assert self.sched is not None
        if self.in_flight is not None:
            return _IN_FLIGHT_POLL_MS
        return _BLOCKED_POLL_MS if self.sched.has_work else _IDLE_POLL_MS

    def _schedule_and_dispatch(self) -> None:
        assert self.sched is not None and self.in_flight is None
        batch = self.sched.schedule()
        if batch is not None:
            self._dispatch(batch)

    def _dispatch(self, batch: ForwardBatch) -> None:
        crash = self.args.faults
        if crash.crash_process == "scheduler" and batch.step == crash.crash_at_step:
            logger.error("fault injection: scheduler crashing at step %d", batch.step)
            os._exit(17)
        data = self.to_workers[0].encode(batch)  # once, not once per rank
        for tx in self.to_workers:
            tx.send_encoded(data, int(self.args.watchdog_timeout * 1000))
        self._sent_at = time.perf_counter()
        if self._result_at is not None:
            self.stats.on_turnaround(self._sent_at - self._result_at)
        self.in_flight = batch
        self.in_flight_since = self.last_sent = time.monotonic()
        if batch.store_clear:
            self._store_clearing, self._store_clear_waiters = self._store_clear_waiters, []

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if self.in_flight is None and now - self.last_sent >= _HEARTBEAT_S:
            for tx in self.to_workers:
                tx.send(Heartbeat(), int(self.args.watchdog_timeout * 1000))
            self.last_sent = now

    def _handle_requests(self) -> list[TokenOut]:
        """Apply every queued tokenizer message; control requests are answered at once, the
        TokenOuts (rejections, aborts) are returned for the caller to send."""
        assert self.sched is not None
        outs: list[TokenOut] = []
        for msg in self.from_tok.drain(4096):
            if isinstance(msg, GenerateReq):
                outs.extend(self.sched.add_request(msg))
            elif isinstance(msg, AbortReq):
                outs.extend(self.sched.abort(msg.rid, msg.reason))
            elif isinstance(msg, GetInfoReq):
                self.to_tok.send(InfoResp(req_id=msg.req_id, info=self._info()))
            elif isinstance(msg, FlushCacheReq):
                ok = self.in_flight is None and self.sched.flush_cache(msg.include_store)
                if ok and msg.include_store and self.sched.res.store is not None:
                    self._store_clear_waiters.append(msg.req_id)  # answered when the workers emptied it
                    continue
                text = "" if ok else "cannot flush the cache while requests are running"
                self.to_tok.send(FlushCacheResp(req_id=msg.req_id, ok=ok, message=text))
            elif isinstance(msg, (LoadLoraReq, UnloadLoraReq)):
                lora = self.sched.lora
                text = lora.load(msg.adapter) if isinstance(msg, LoadLoraReq) else lora.unload(msg.name)
                self.to_tok.send(LoraResp(req_id=msg.req_id, ok=not text, message=text))
        return outs

    def _handle_worker_msgs(self) -> list[TokenOut]:
        """Apply the in-flight batch's StepResult; returns its TokenOuts (not yet sent)."""
        assert self.sched is not None
        outs: list[TokenOut] = []
        for msg in self.from_workers.drain(64):
            if not isinstance(msg, StepResult):
                continue
            if self.in_flight is None or msg.step != self.in_flight.step:
                logger.warning("ignoring StepResult for step %d", msg.step)
                continue
            self.in_flight = None
            self._result_at = time.perf_counter()
            self.stats.on_result(self._result_at - self._sent_at, msg.elapsed_s)
            outs.extend(self.sched.apply_result(msg))
            for req_id in self._store_clearing:
                text = f"the state store was not emptied: {msg.error}" if msg.error else "cache and state store flushed"
                self.to_tok.send(FlushCacheResp(req_id=req_id, ok=not msg.error, message=text))
            self._store_clearing = []
        return outs

    def _check_watchdog(self) -> None:
        if self.in_flight is None:
            return
        waited = time.monotonic() - self.in_flight_since
        if waited > self.args.watchdog_timeout:
            raise TimeoutError(
                f"watchdog: no reply from the workers for step {self.in_flight.step} in {waited:.1f}s"
            )

    def _send_outs(self, outs: list[TokenOut]) -> None:
        if outs:
            self.to_tok.send(TokenOutBatch(outs=outs))

    def _info(self) -> SchedulerInfo:
        assert self.sched is not None
        step = self.in_flight.step if self.in_flight is not None else -1
        return msgspec.structs.replace(self.sched.info(), in_flight_step=step, loop=self.stats.info())

    def write_back(self) -> None:
        """Under --hicache-write-policy write_back: send the workers every cached prefix to store before
        they are told to shut down (they finish their queued writes then)."""
        if self.sched is None or self.in_flight is not None:
            return
        batch = self.sched.write_back_batch()
        if batch is not None:
            logger.info("write-back: storing %d cached prefixes", len(batch.store_writes))
            self._dispatch(batch)

    def fail_everything(self, reason: str) -> None:
        """Best effort on the way down: one final error per unfinished request."""
        if self.sched is not None:
            try:
                self._send_outs(self.sched.fail_all(reason))
            except Exception:  # noqa: BLE001 - we are already failing
                logger.exception("could not send final errors")


def open_store_tier(args: ServerArgs, model: ModelInfo, namespace_json: str) -> StoreTier:
    """The scheduler's view of the state store whose namespace rank 0 reported: block keys in its
    chain namespace, lookups in rank 0's folder."""
    namespace = StoreNamespace(**json.loads(namespace_json))
    try:
        contains = open_probe(args, namespace)
    except StoreError as e:
        raise StartupError(f"state store ({args.hicache_storage_backend}): {e}") from e
    return StoreTier(namespace, contains, args.state_cache_block_tokens, model.has_attention,
                     model.has_recurrent_state, args.hicache_write_policy == "write_back")


class StopRequested(BaseException):
    """STOP_SIGNAL from launch.py: leave the loop and tell the workers (of every node) to stop."""


def _raise_stop(signum: int, _frame: object) -> None:
    raise StopRequested(signal.Signals(signum).name)


def run(args: ServerArgs) -> None:
    """Process entry: wait for the workers, report ready, serve until launch.py's STOP_SIGNAL or a
    failure. On STOP_SIGNAL every rank is sent Shutdown, so the workers of other nodes exit (code 0)
    now instead of after the heartbeat silence limit."""
    loop = SchedulerLoop(args)
    signal.signal(STOP_SIGNAL, _raise_stop)
    try:
        loop.start()
        loop.run_forever()
    except StopRequested:
        logger.info("stopping: telling every worker rank to shut down")
        loop.fail_everything("server shutting down")
        loop.write_back()
        for tx in loop.to_workers:
            try:
                tx.send(Shutdown(reason="scheduler stopped"), 1000)
                tx.close(linger_ms=1000)
            except ChannelTimeout:
                pass
    except Exception as e:
        logger.error("scheduler failing: %s", e)
        loop.fail_everything(str(e))
        raise
