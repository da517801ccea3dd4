"""Scheduler: the pure logic of the scheduler process (docs/architecture.md, "Request lifecycle").

Owns the request table, the waiting queue, the running set, the RetryPolicy (retry.py) and, through
ReqResources (resources.py), the slot allocators and the HybridRadixCache; admission is admission.py,
what a StepResult does to the requests of its batch is results.py. No sockets, no tensors,
single-threaded: `process.py` calls it. At most one batch is in flight: `schedule` is only called when
none is, and `apply_result` applies it.

Rule: a request changes status only in `transition` (waiting -> running on admission, running ->
waiting on retraction or a worker's refusal, waiting or running -> finished), which keeps its
status, the waiting queue, the running set, `running_version` and its resources consistent.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

from scheduler_proc.admission import Admission, AdmissionLimits, PrefillAdder, reserve
from scheduler_proc.batch import BatchBuilder, InFlight
from scheduler_proc.drafting import Speculation, SpeculationConfig
from scheduler_proc.introspect import check_scheduler, server_info
from scheduler_proc.lora_slots import AdapterUse, LoraSlots
from scheduler_proc.metrics import SchedulerMetrics
from scheduler_proc.radix_cache import HybridRadixCache
from scheduler_proc.request import Req, ReqStatus, WaitingQueue, token_out, validate
from scheduler_proc.resources import ReqResources, clamp_max_running
from scheduler_proc.results import apply_step
from scheduler_proc.retry import RetryPolicy
from scheduler_proc.store_tier import LoadTicket, StoreTier
from shared.config import ServerArgs
from shared.messages import (
    FinishReason,
    ForwardBatch,
    GenerateReq,
    SchedulerInfo,
    StepResult,
    StoreStats,
    TokenOut,
)
from shared.model_info import ModelInfo

logger = logging.getLogger(__name__)

WRITE_POLL_S = 0.1
"""While only the store's writes are queued, a batch asks for its counters at most this often."""


@dataclass(frozen=True)
class SchedulerTuning:
    """KV reserved for a running request's future tokens = remaining max_new_tokens x ratio. The ratio
    decays every round towards `min_ratio` and jumps up by `retract_step` after a retraction."""

    init_ratio: float = 0.7
    min_ratio: float = 0.1
    decay: float = 0.001
    retract_step: float = 0.2


class Scheduler:
    """Request table, waiting queue, running set, ReqResources (allocators and cache), RetryPolicy.
    No sockets, no tensors, single-threaded."""

    def __init__(
        self,
        args: ServerArgs,
        model: ModelInfo,
        kv_capacity: int,
        state_capacity: int,
        tuning: SchedulerTuning | None = None,
        store: StoreTier | None = None,
    ) -> None:
        self.args = args
        self.model = model
        self.tuning = tuning or SchedulerTuning()
        self.context_length = args.context_length or model.max_position_embeddings
        self.track_states = model.has_recurrent_state
        self.res = ReqResources(
            kv_capacity, state_capacity, self.track_states, not args.disable_radix_cache,
            args.mamba_checkpoint_interval, not args.disable_prompt_checkpoint, store,
        )  # fmt: skip
        self.metrics = SchedulerMetrics()
        self.retry = RetryPolicy.for_config(args, model)
        self.max_running = clamp_max_running(args.max_running_requests, state_capacity, self.track_states)
        self.reqs: dict[str, Req] = {}
        self._reuse: dict[str, Req] = {}  # rid -> request waiting for the aborted holder of its rid to leave
        self._ended: list[str] = []  # grammar requests finished since the last batch (ForwardBatch.ended)
        # preemption implies priority order: under FCFS a retracted (older) victim would sort before the
        # request it made room for and be re-admitted in its place, round after round
        self.waiting = WaitingQueue(args.schedule_policy == "priority" or args.enable_priority_preemption)
        self.running: dict[str, Req] = {}
        self.loading: dict[str, Req] = {}  # requests whose stored prefix is loading (in the batch in flight)
        self.store_stats: StoreStats | None = None  # rank 0's state store counters, as of the last StepResult
        self._write_polled = 0.0  # monotonic time of the last batch sent to poll the store
        self.running_version = 0  # changes exactly when the running set does (in `transition`)
        self.new_token_ratio = self.tuning.init_ratio
        limits = AdmissionLimits(args.max_prefill_tokens, args.chunked_prefill_size, self.max_running,
                                 self.track_states)  # fmt: skip
        self.lora = LoraSlots(args.max_loras_per_batch, args.enable_lora)
        self.admission = Admission(self.waiting, self.retry, self.res, self.metrics, limits, lora=self.lora)
        self.speculation = Speculation(SpeculationConfig.from_args(args), self.res, self.context_length)
        self._seq = itertools.count()
        self._step = 0
        self.in_flight: InFlight | None = None
        self.eos_ids = frozenset(model.eos_token_ids)

    @property
    def cache(self) -> HybridRadixCache:
        return self.res.cache

    @property
    def has_work(self) -> bool:
        return bool(self.running) or bool(self.loading) or len(self.waiting) > 0

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, req: GenerateReq) -> list[TokenOut]:
        """Rejects a request that can never run (final reply with `rejected`). A rid whose holder was
        aborted while its slice is in flight is free again: the new request waits in `_reuse` and joins
        the table when the holder leaves it (when that step is applied)."""
        res = self.res
        holder = self.reqs.get(req.rid)
        reuse = holder is not None and holder.abort_reason is not None and req.rid not in self._reuse
        error = validate(req, holder is not None and not reuse, self.context_length, res.kv_alloc.capacity,
                         res.state_alloc.capacity if self.track_states else None)  # fmt: skip
        use, lora_error = self._adapter_of(req)
        error = error or lora_error
        if error:
            logger.info("rejecting request %s: %s", req.rid, error)
            return [TokenOut(rid=req.rid, token_ids=[], finished=True, finish_reason="error", error=error,
                             prompt_tokens=len(req.input_ids), rejected=True)]  # fmt: skip
        if req.sampling.max_new_tokens == 0:  # nothing to compute: answered without entering the table
            return [TokenOut(rid=req.rid, token_ids=[], finished=True, finish_reason="length",
                             prompt_tokens=len(req.input_ids))]  # fmt: skip
        r = Req(req.rid, req.input_ids, req.sampling, req.priority, next(self._seq), tuple(req.images), use)
        if use is not None:
            self.lora.attach(use)
        r.save_prompt_state = req.save_prompt_state
        if reuse:
            self._reuse[r.rid] = r
        else:
            self.reqs[r.rid] = r
            self.waiting.push(r)
        return []

    def _adapter_of(self, req: GenerateReq) -> tuple[AdapterUse | None, str]:
        """The adapter `req` names (None: the base model), or why it cannot run under it."""
        if not req.lora:
            return None, ""
        if not self.lora.enabled:
            return None, f"LoRA adapter {req.lora!r} asked for, but LoRA is off (--enable-lora)"
        use = self.lora.lookup(req.lora)
        return use, "" if use is not None else f"unknown LoRA adapter {req.lora!r}"

    def _drop_reusing(self, r: Req) -> None:
        """A request that waited for its rid's holder ends without entering the table."""
        if r.lora is not None:
            self.lora.detach(r.lora)

    @property
    def reusing(self) -> dict[str, Req]:
        """Requests waiting for the aborted holder of their rid to leave (not yet in the table)."""
        return self._reuse

    def abort(self, rid: str, reason: str = "") -> list[TokenOut]:
        if (reusing := self._reuse.pop(rid, None)) is not None:  # the holder is aborted already
            self._drop_reusing(reusing)
            return [token_out(reusing, [], "abort")]
        r = self.reqs.get(rid)
        if r is None:
            return []
        if r.status is ReqStatus.LOADING or (self.in_flight is not None and rid in self.in_flight.by_rid):
            r.abort_reason = reason or "aborted"  # finished when its StepResult (or its load's) is applied
            return []
        return [self.finish(r, "abort")]

    def fail_all(self, reason: str) -> list[TokenOut]:
        """Final error for every unfinished request; everything they hold is freed (nothing donated:
        the in-flight step may have half-written their slots) and the cache is flushed."""
        self.in_flight = None
        outs = [token_out(r, [], "error", error=reason) for r in self._reuse.values()]
        for r in self._reuse.values():
            self._drop_reusing(r)
        self._reuse.clear()
        for r in list(self.loading.values()):
            assert r.load is not None
            self.res.finish_load(r, r.load, False)
            r.load = None
        outs += [self.finish(r, "error", error=reason) for r in list(self.reqs.values())]
        self.res.flush()
        return outs

    def write_back_batch(self) -> ForwardBatch | None:
        """At a graceful shutdown under write-back: one batch that only writes every cached prefix
        (None with a batch in flight, or nothing to write)."""
        if self.in_flight is not None or self.res.store is None:
            return None
        self.res.write_back_everything()
        b = BatchBuilder(self._step + 1)
        b.store_writes = self.res.store.take_writes()
        if b.empty:
            return None
        batch, self.in_flight = b.build()
        self._step += 1
        return batch

    def flush_cache(self, include_store: bool = False) -> bool:
        """Empty the memory cache (and with `include_store` the state store, by the next batch);
        False while requests run or load."""
        if self.running or self.loading or self.in_flight is not None:
            return False
        self.res.flush()
        if include_store and self.res.store is not None:
            self.res.store.clear()
        return True

    # ------------------------------------------------------------------ one round
    def schedule(self) -> ForwardBatch | None:
        if self.in_flight is not None:
            raise RuntimeError("schedule() called while a batch is in flight")
        b = BatchBuilder(self._step + 1, next_token_inputs=self.speculation.runs_mtp)
        self._fit_running()
        self._preempt_for_priority()
        for r in list(self.running.values()):
            if r.pending_ckpt:
                result = self.res.checkpoint(r, b)
                if result != "exists":
                    self.metrics.inc("hyssm_checkpoints_total", result=result)
        prefill_used = self._schedule_running(b)
        self.admission.admit(self, b, prefill_used)
        self.speculation.attach(b)
        self.new_token_ratio = max(self.tuning.min_ratio, self.new_token_ratio - self.tuning.decay)
        if (store := self.res.store) is not None:
            b.store_writes = store.take_writes()
            b.store_clear, store.clear_pending = store.clear_pending, False
            # loads pending, or writes queued (asked every WRITE_POLL_S): a batch even with nothing else,
            # so that loads settle and the store's counters arrive while nothing runs
            now = time.monotonic()
            writing = self.store_stats is not None and self.store_stats.queued_bytes > 0
            b.poll = bool(self.loading) or (writing and now - self._write_polled >= WRITE_POLL_S)
            if b.poll:
                self._write_polled = now
        if not b.entries:
            assert not b.ckpt_copies and not b.cow_copies, "state ops without a request to run them"
        if b.empty:
            return None
        batch, self.in_flight = b.build()
        batch.ended, self._ended = self._ended, []
        self._step += 1
        return batch

    def _fit_running(self) -> None:
        """Every running request must get at least one KV token this round; retract until they can."""
        while len(self.running) > 1 and len(self.running) > self.res.available_kv():
            self._retract(self._pick_victim(list(self.running.values())), "kv")

    def _pick_victim(self, candidates: list[Req]) -> Req:
        """Lowest priority (under the priority policy), then newest."""
        if self.waiting.by_priority:
            return min(candidates, key=lambda r: (r.priority, -r.seq))
        return max(candidates, key=lambda r: r.seq)

    def _retract(self, r: Req, cause: str) -> None:
        r.retracted_at = r.computed
        self.transition(r, ReqStatus.WAITING, donate=True, keep=True)
        self.metrics.inc("hyssm_retractions_total", cause=cause)
        self.metrics.inc("hyssm_retracted_tokens_total", r.retracted_at)
        if cause == "kv":
            self.new_token_ratio = min(1.0, self.new_token_ratio + self.tuning.retract_step)
        logger.debug("retracted %s (%s)", r.rid, cause)

    def _preempt_for_priority(self) -> None:
        """With --enable-priority-preemption: retract lower-priority running requests while the
        highest-priority waiting request does not fit and retracting them could make it fit."""
        head = self.waiting.peek() if self.args.enable_priority_preemption else None
        while head is not None:
            victims = [r for r in self.running.values() if r.priority < head.priority]
            if not victims:
                return
            budget = self.admission.budget(self, 0)
            kv, states = PrefillAdder(budget).need(head, self.res.peek(head))
            short_kv, short_states = kv - budget.kv, states - budget.states
            short_running = 1 - budget.running_slots
            if short_kv <= 0 and short_states <= 0 and short_running <= 0:
                return
            gain_kv = sum(len(r.kv_slots) - r.tree_len + reserve(r, self.new_token_ratio) for r in victims)
            if short_kv > gain_kv or short_states > len(victims) or short_running > len(victims):
                return
            self._retract(self._pick_victim(victims), "priority")

    def _schedule_running(self, b: BatchBuilder) -> int:
        """Decode tokens first (one each), then continuations of chunked prefills. Returns the prefill
        tokens scheduled."""
        decoding = [r for r in self.running.values() if not r.is_prefilling]
        for r in decoding:
            if not self.res.grow(r, 1):
                raise AssertionError(f"no KV slot for decoding {r} after _fit_running")
            b.add(r, 1, prefill=False)
        used = 0
        for r in self.running.values():
            if not r.is_prefilling:
                continue
            room = min(self.args.max_prefill_tokens - used, self.res.available_kv())
            n = min(len(r.tokens) - r.computed, self.args.chunked_prefill_size, room, self.res.next_split_cap(r))
            if n >= 1 and self.res.grow(r, n):
                b.add(r, n, prefill=True)
                used += n
        return used

    # ------------------------------------------------------------------ results (results.py)
    def apply_result(self, result: StepResult) -> list[TokenOut]:
        """Apply rank 0's reply to the batch in flight (results.py); the TokenOuts it produces.
        Raises ValueError for a reply to any other step."""
        fl = self.in_flight
        if fl is None or result.step != fl.step:
            raise ValueError(f"StepResult for step {result.step}, in flight: {fl.step if fl else None}")
        self.in_flight = None
        if result.store is not None:
            self.store_stats = result.store
        outs = apply_step(self, fl, result)
        if result.error:  # the ranks may not hold the adapters this step was to load
            self.lora.forget_slots(fl.lora_slots)
        return outs

    # ------------------------------------------------------------------ the doors and the one status change
    def start_load(self, r: Req, ticket: LoadTicket) -> None:
        """The queue head waits for a load from the state store (admission's door into LOADING)."""
        r.load = ticket
        self.transition(r, ReqStatus.LOADING)

    def finish(self, r: Req, reason: FinishReason, new: list[int] | None = None, matched: int | None = None,
               logprobs: list[float] | None = None, error: str | None = None,
               top: list[list[tuple[int, float]]] | None = None, rejected: bool = False) -> TokenOut:  # fmt: skip
        """Finish `r` (never while its slice is in flight): give back or donate what it holds.
        `rejected`: an "error" that is the request's own fault (TokenOut.rejected)."""
        self.transition(r, ReqStatus.FINISHED, donate=reason != "error")
        self.speculation.forget(r.rid)
        if r.sampling.grammar is not None:
            self._ended.append(r.rid)
        if (reusing := self._reuse.pop(r.rid, None)) is not None:  # a new request waited for this rid
            self.reqs[r.rid] = reusing
            self.waiting.push(reusing)
        self.metrics.inc("hyssm_requests_finished_total", reason=reason)
        return token_out(r, new or [], reason, matched=matched, logprobs=logprobs, error=error, top=top,
                         rejected=rejected)

    def start(self, r: Req) -> None:
        """The admitted queue head becomes RUNNING (admission's door into the running set)."""
        self.transition(r, ReqStatus.RUNNING)

    def transition(self, r: Req, to: ReqStatus, donate: bool = False, keep: bool = False) -> None:
        """Move `r` from its status to `to` (WAITING <-> RUNNING, WAITING <-> LOADING, any -> FINISHED),
        never while its slice or its load is in flight. Leaving RUNNING gives back everything it holds
        (`donate`: its computed KV and state move into the cache; `keep`: as a retracted request's
        progress, evicted last); entering RUNNING or LOADING takes nothing (ReqResources.start and
        start_load took the slots); a load's ticket is settled before the request leaves LOADING
        (`results.settle_loads`); a WAITING or LOADING request finishing ends its kept progress.
        FINISHED leaves the request table.
        `running_version` changes exactly when the running set does."""
        frm = r.status
        assert frm is not to and frm is not ReqStatus.FINISHED, f"{r}: {frm.value} -> {to.value}"
        assert (frm is ReqStatus.LOADING) <= (to is not ReqStatus.RUNNING), f"{r}: loading -> running"
        assert r.load is None or to is ReqStatus.LOADING, f"{r} leaves {frm.value} holding a load"
        if to in (ReqStatus.RUNNING, ReqStatus.LOADING) and self.waiting.peek() is not r:
            raise AssertionError(f"admitting {r}, but the queue head is {self.waiting.peek()}")
        if frm is ReqStatus.RUNNING:
            self.res.release(r, donate=donate, keep=keep)
            del self.running[r.rid]
            if r.lora is not None:
                self.lora.stopped(r.lora)
        elif frm is ReqStatus.LOADING:
            del self.loading[r.rid]
            if to is ReqStatus.FINISHED:
                self.res.end_kept_progress(r)
        elif to in (ReqStatus.RUNNING, ReqStatus.LOADING):
            self.waiting.pop()
        else:
            self.waiting.remove(r)
            self.res.end_kept_progress(r)
        if to is ReqStatus.RUNNING:
            self.running[r.rid] = r
            if r.lora is not None:
                self.lora.started(r.lora)
        elif to is ReqStatus.LOADING:
            self.loading[r.rid] = r
        elif to is ReqStatus.WAITING:
            self.waiting.push(r)
        else:
            del self.reqs[r.rid]
            if r.lora is not None:
                self.lora.detach(r.lora)
        if ReqStatus.RUNNING in (frm, to):
            self.running_version += 1
        r.status = to

    # ------------------------------------------------------------------ introspection
    def info(self) -> SchedulerInfo:
        return server_info(self)

    def check_integrity(self) -> None:
        check_scheduler(self)
