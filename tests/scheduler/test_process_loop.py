"""`SchedulerLoop` (scheduler_proc/process.py) over real zmq channels, one `run_once` at a time:
the next batch leaves before the applied step's TokenOuts, requests queued during a step join the
next batch, and an idle loop with blocked work waits instead of polling with a zero timeout."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import zmq

from scheduler_proc import process
from scheduler_proc.process import SchedulerLoop
from shared.channels import (
    SCHEDULER_TO_TOKENIZER,
    SCHEDULER_TO_WORKER,
    TO_LAUNCHER,
    TOKENIZER_TO_SCHEDULER,
    WORKER_TO_SCHEDULER,
    Receiver,
    Sender,
)
from shared.config import ServerArgs
from shared.messages import (
    AbortReq,
    ForwardBatch,
    GenerateReq,
    LoadLoraReq,
    LoraAdapter,
    LoraResp,
    ProcReady,
    SamplingParams,
    StepResult,
    TokenOutBatch,
    UnloadLoraReq,
    WorkerReady,
)
from tests.fixtures.lora_adapter import write_adapter

pytestmark = pytest.mark.timeout(60)


@dataclass
class Recorder:
    """Stands in for a Sender: records (channel, message) into a log shared by every recorder."""

    name: str
    log: list[tuple[str, Any]] = field(default_factory=list)

    def send(self, msg: Any, timeout_ms: int = 0) -> None:
        self.log.append((self.name, msg))

    def encode(self, msg: Any) -> Any:  # the "encoded" form is the message itself, so the log stays readable
        return msg

    def send_encoded(self, data: Any, timeout_ms: int = 0) -> None:
        self.send(data, timeout_ms)


@dataclass
class Peers:
    loop: SchedulerLoop
    tok: Sender  # plays the tokenizer
    worker: Sender  # plays worker rank 0
    log: list[tuple[str, Any]]

    def submit(self, rid: str, max_new: int = 3) -> None:
        sp = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
        self.tok.send(GenerateReq(rid=rid, input_ids=[5, 6, 7], sampling=sp))

    def sent(self) -> list[tuple[str, Any]]:
        out = list(self.log)
        self.log.clear()
        return out

    def run_until(self, pred: Any, limit_s: float = 10.0) -> None:
        """run_once until `pred()` holds: messages sent over ipc arrive asynchronously."""
        deadline = time.monotonic() + limit_s
        while not pred():
            assert time.monotonic() < deadline, "the loop did not get there in time"
            self.loop.run_once()


@pytest.fixture
def peers(request: pytest.FixtureRequest) -> Iterator[Peers]:
    """The loop over the built-in model; an indirect param lists adapters to serve from --lora-paths."""
    with tempfile.TemporaryDirectory(prefix="hyssm-loop-") as run_dir:
        lora = tuple(f"{n}={write_adapter(os.path.join(run_dir, n))}" for n in getattr(request, "param", ()))
        args = ServerArgs(run_dir=run_dir, max_total_tokens=256, max_mamba_cache_size=16, lora_paths=lora)
        ctx = zmq.Context()
        launcher = Receiver(ctx, TO_LAUNCHER, args)
        loop = SchedulerLoop(args)
        # a connected peer on every channel the loop sends on, so its sockets have somewhere to go
        worker_rx = Receiver(ctx, SCHEDULER_TO_WORKER, args, 0)
        tok_rx = Receiver(ctx, SCHEDULER_TO_TOKENIZER, args)
        worker = Sender(ctx, WORKER_TO_SCHEDULER, args)
        tok = Sender(ctx, TOKENIZER_TO_SCHEDULER, args)
        worker.send(WorkerReady(rank=0, kv_slots=256, state_slots=16, device="cpu", dtype="float32"))
        loop.start()
        assert isinstance(launcher.recv(5000), ProcReady)
        log: list[tuple[str, Any]] = []
        loop.to_workers = [Recorder("worker", log)]  # type: ignore[list-item]
        loop.to_tok = Recorder("tokenizer", log)  # type: ignore[assignment]
        try:
            yield Peers(loop, tok, worker, log)
        finally:
            for s in (launcher, worker_rx, tok_rx, worker, tok):
                s.close()
            for s in (loop.from_tok, loop.from_workers):
                s.close()
            ctx.destroy(linger=0)
            loop.ctx.destroy(linger=0)


def _batches(sent: list[tuple[str, Any]]) -> list[ForwardBatch]:
    return [m for ch, m in sent if ch == "worker" and isinstance(m, ForwardBatch)]


def test_next_batch_leaves_before_the_step_outputs(peers: Peers) -> None:
    peers.submit("a")
    peers.run_until(lambda: peers.loop.in_flight is not None)
    first = _batches(peers.sent())
    assert [r.rid for r in first[0].reqs] == ["a"]
    peers.submit("b")  # arrives while step 1 runs: must join step 2
    peers.worker.send(StepResult(step=first[0].step, next_tokens={"a": 11}))
    peers.run_until(lambda: peers.loop.in_flight is not None and peers.loop.in_flight.step > first[0].step)
    sent = peers.sent()
    kinds = [(ch, type(m).__name__) for ch, m in sent]
    assert kinds == [("worker", "ForwardBatch"), ("tokenizer", "TokenOutBatch")], kinds
    second, outs = sent[0][1], sent[1][1]
    assert sorted(r.rid for r in second.reqs) == ["a", "b"]
    assert isinstance(outs, TokenOutBatch) and [(o.rid, o.token_ids) for o in outs.outs] == [("a", [11])]


def test_loop_stats_split_round_trip_worker_time_and_turnaround(peers: Peers) -> None:
    peers.submit("a", max_new=2)
    peers.run_until(lambda: peers.loop.in_flight is not None)
    sent_at = time.perf_counter()
    peers.worker.send(StepResult(step=peers.loop.in_flight.step, next_tokens={"a": 11}, elapsed_s=0.001))
    peers.run_until(lambda: peers.loop.stats.steps == 1)
    after = time.perf_counter()
    stats = peers.loop.stats
    stats.check_integrity()
    assert stats.worker_s == 0.001 and 0 < stats.round_trip_s
    assert stats.turnarounds == 1  # step 2 (a's last token) left in the same round
    assert 0 < stats.turnaround_s < after - sent_at
    peers.worker.send(StepResult(step=peers.loop.in_flight.step, next_tokens={"a": 12}, elapsed_s=0.002))
    peers.run_until(lambda: peers.loop.stats.steps == 2)
    assert stats.turnarounds == 1, "no batch followed the last step: nothing to count"
    loop_info = peers.loop._info().loop
    assert loop_info.steps == 2 and loop_info.worker_ms_mean == pytest.approx(1.5)
    assert loop_info.round_trip_ms_mean > 0 and loop_info.turnaround_ms_mean > 0


def test_step_outputs_precede_replies_to_requests_of_the_same_round(peers: Peers) -> None:
    """A StepResult and an abort of one of its requests handled in one round: the next batch
    leaves without that request, and the tokenizer gets its last token before its final abort."""
    peers.submit("a")
    peers.submit("b")
    peers.run_until(lambda: peers.loop.in_flight is not None and len(peers.loop.in_flight.reqs) == 2)
    step = _batches(peers.sent())[-1].step
    peers.tok.send(AbortReq(rid="a", reason="gone"))
    peers.worker.send(StepResult(step=step, next_tokens={"a": 11, "b": 12}))
    assert peers.loop.from_tok.sock.poll(5000) and peers.loop.from_workers.sock.poll(5000)
    peers.loop.run_once()
    sent = peers.sent()
    assert [ch for ch, _ in sent] == ["worker", "tokenizer"]
    assert [r.rid for r in sent[0][1].reqs] == ["b"]
    outs = [(o.rid, o.token_ids, o.finished, o.finish_reason) for o in sent[1][1].outs]
    assert outs == [("a", [11], False, None), ("b", [12], False, None), ("a", [], True, "abort")]


def test_blocked_idle_loop_waits_instead_of_spinning(peers: Peers, monkeypatch: pytest.MonkeyPatch) -> None:
    """Work queued that cannot be scheduled (forced here) and nothing in flight: the poll timeout
    is the bounded blocked wait, never 0 (a busy loop on a core the workers need)."""
    assert peers.loop.sched is not None
    monkeypatch.setattr(peers.loop.sched, "schedule", lambda: None)
    peers.submit("a")
    peers.run_until(lambda: peers.loop.sched is not None and peers.loop.sched.has_work)
    assert peers.loop.in_flight is None
    assert peers.loop._poll_timeout_ms() == process._BLOCKED_POLL_MS > 0
    t0 = time.monotonic()
    peers.loop.run_once()
    assert time.monotonic() - t0 >= process._BLOCKED_POLL_MS / 1000 * 0.5
    assert not _batches(peers.sent())


@pytest.mark.parametrize("peers", [("sql",)], indirect=True)
def test_adapters_from_lora_paths_and_load_unload_messages(peers: Peers) -> None:
    sched = peers.loop.sched
    assert sched is not None and list(sched.lora.by_name) == ["sql"]
    sp = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
    peers.tok.send(GenerateReq(rid="a", input_ids=[5, 6, 7], sampling=sp, lora="sql"))
    peers.run_until(lambda: peers.loop.in_flight is not None)
    (batch,) = _batches(peers.sent())
    assert [(load.slot, load.adapter.name) for load in batch.lora_loads] == [(1, "sql")]
    assert batch.reqs[0].lora_slot == 1 and batch.reqs[0].input_ids == [5, 6, 7]
    other = LoraAdapter(name="chat", path="/a/chat", uid="u2", rank=8, scaling=2.0, targets=("q_proj",))
    for msg in (LoadLoraReq(req_id=1, adapter=other), LoadLoraReq(req_id=2, adapter=other),
                UnloadLoraReq(req_id=3, name="sql"), UnloadLoraReq(req_id=4, name="sql")):
        peers.tok.send(msg)
    peers.run_until(lambda: len(peers.log) >= 4)
    answers = [(m.req_id, m.ok, m.message) for _, m in peers.sent() if isinstance(m, LoraResp)]
    assert [(i, ok) for i, ok, _ in answers] == [(1, True), (2, False), (3, True), (4, False)]
    assert "loaded already" in answers[1][2] and "not loaded" in answers[3][2]
    assert sched.lora.draining and sched.running["a"].lora is sched.lora.draining[0]  # a finishes under sql
    sched.check_integrity()
