"""Admission: which waiting requests join the running batch this round, and what they may take.

One hop for every admission question:
- the budget (`Admission.budget`): KV tokens (free + evictable, minus what running requests reserve for
  their future tokens, `reserve`), state slots (free + evictable), the round's prefill tokens
  left after chunk continuations, free running slots, the chunk size;
- `PrefillAdder`: pure arithmetic over that snapshot, one request at a time; it never allocates or
  touches the cache. Results: CONTINUE (granted), NO_TOKEN (out of memory: sets the full-batch latch),
  OTHER (a per-round budget is used up: deferred, no latch);
- the loop (`Admission.admit`): in queue order, peek the request's cache match, check that its LoRA
  adapter can have an adapter slot (lora_slots.py; refused with reason "lora_slot" like a memory
  refusal when every slot is pinned by running requests), ask the adder, then take the slots
  (`ReqResources.start`), put the adapter in its slot (the batch's `lora_loads`) and move the request to
  RUNNING (`Running.start`).
`Admission` holds what it works with (the waiting queue, the retry policy, the resources, the
metrics, the round's limits) and sees the running set only through `Running`, a narrow view.

Rules: the adder is asked *before* anything is locked, allocated or copied for a request, and
`rollback` undoes its grant if a later step fails (the state or KV allocation, a copy-on-write
allocation failure), so a refused admission leaves no trace in the budget or the cache. The first
refusal for memory ends the round's admission (the queue head keeps its place: no request overtakes
it by being smaller); when to try again is `retry.py`'s rule. An idle scheduler whose head cannot
afford its own cache hit (the matched state is the only one) admits it without the hit instead.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from scheduler_proc.batch import BatchBuilder
from scheduler_proc.lora_slots import LoraSlots
from scheduler_proc.metrics import SchedulerMetrics
from scheduler_proc.radix_cache import PeekResult
from scheduler_proc.request import Req, WaitingQueue
from scheduler_proc.resources import ReqResources
from scheduler_proc.retry import RetryPolicy
from scheduler_proc.store_tier import LoadTicket, StoredPrefix
from shared.errors import StateCowAllocError

logger = logging.getLogger(__name__)


class AddResult(Enum):
    CONTINUE = "continue"  # admitted; try the next request
    NO_TOKEN = "no_token"  # out of memory (KV tokens or state slots): sets the full-batch latch
    OTHER = "other"  # a per-round budget (prefill tokens, running requests) is used up


@dataclass(frozen=True, slots=True)
class AdderBudget:
    """Snapshot at the start of admission. kv/states: free + evictable, minus what running requests
    have reserved; prefill_tokens: the round's prefill budget left after chunk continuations."""

    kv: int
    states: int
    prefill_tokens: int
    running_slots: int
    chunk_size: int
    new_token_ratio: float
    needs_state: bool


@dataclass(frozen=True, slots=True)
class Grant:
    kv: int  # KV tokens reserved (lock cost + prompt to compute + estimated new tokens)
    states: int  # state slots reserved (own slot + the matched state taken out of the evictable pool)
    chunk: int  # tokens to compute this round


class Candidate(Protocol):
    """What the adder needs to know about a request (Req satisfies it)."""

    @property
    def tokens(self) -> list[int]: ...
    @property
    def num_output(self) -> int: ...
    @property
    def max_new_tokens(self) -> int: ...


class MatchCost(Protocol):
    """What the adder needs to know about the request's cache match (PeekResult satisfies it)."""

    @property
    def prefix_len(self) -> int: ...
    @property
    def lock_cost_kv(self) -> int: ...
    @property
    def state_lock_cost(self) -> int: ...


def reserve_new_tokens(remaining_new: int, ratio: float) -> int:
    """KV tokens held back for a request's future output tokens (estimate: a ratio of the maximum)."""
    return math.ceil(max(0, remaining_new) * ratio)


class PrefillAdder:
    """The round's budget, drawn down by each grant (see the module docstring)."""

    def __init__(self, budget: AdderBudget) -> None:
        self.budget = budget
        self.rem_kv = budget.kv
        self.rem_states = budget.states
        self.rem_prefill = budget.prefill_tokens
        self.rem_running = budget.running_slots
        self.granted: list[Grant] = []
        self.refusal_reason = ""  # "kv" | "mamba_state" | "running" | "prefill" after a refusal

    def need(self, req: Candidate, match: MatchCost) -> tuple[int, int]:
        """(KV tokens, state slots) that admitting `req` with `match` takes from the budget."""
        extend = len(req.tokens) - match.prefix_len
        future_new = req.max_new_tokens - req.num_output - 1
        kv = match.lock_cost_kv + extend + reserve_new_tokens(future_new, self.budget.new_token_ratio)
        states = (1 + match.state_lock_cost) if self.budget.needs_state else 0
        return kv, states

    def add_one_req(self, req: Candidate, match: MatchCost, max_chunk: int) -> tuple[AddResult, Grant | None]:
        """Check every budget; on CONTINUE reserve and return the grant (chunk <= max_chunk)."""
        if self.rem_running <= 0:
            self.refusal_reason = "running"
            return AddResult.OTHER, None
        if self.rem_prefill <= 0:
            self.refusal_reason = "prefill"
            return AddResult.OTHER, None
        kv, states = self.need(req, match)
        if kv > self.rem_kv:
            self.refusal_reason = "kv"
            return AddResult.NO_TOKEN, None
        if states > self.rem_states:
            self.refusal_reason = "mamba_state"
            return AddResult.NO_TOKEN, None
        extend = len(req.tokens) - match.prefix_len
        chunk = max(1, min(extend, self.budget.chunk_size, self.rem_prefill, max_chunk))
        grant = Grant(kv, states, chunk)
        self.rem_kv -= kv
        self.rem_states -= states
        self.rem_prefill -= chunk
        self.rem_running -= 1
        self.granted.append(grant)
        return AddResult.CONTINUE, grant

    def take(self, kv: int, states: int) -> bool:
        """Reserve what a load from the state store fills (no running slot, no prefill tokens); False,
        with `refusal_reason` set and nothing reserved, when the budget cannot."""
        if kv > self.rem_kv:
            self.refusal_reason = "kv"
            return False
        if states > self.rem_states:
            self.refusal_reason = "mamba_state"
            return False
        self.rem_kv -= kv
        self.rem_states -= states
        return True

    def rollback(self, grant: Grant) -> None:
        """Undo a grant whose admission failed after the budget check (e.g. StateCowAllocError)."""
        self.granted.remove(grant)
        self.rem_kv += grant.kv
        self.rem_states += grant.states
        self.rem_prefill += grant.chunk
        self.rem_running += 1


# ---------------------------------------------------------------------- the round's budget and loop
class Running(Protocol):
    """What admission sees of the running set (the Scheduler satisfies it): the running requests, a
    version that changes exactly when the set does, the share of max_new_tokens reserved for their
    future tokens, and the one door by which an admitted request becomes RUNNING."""

    @property
    def running(self) -> Mapping[str, Req]: ...
    @property
    def running_version(self) -> int: ...
    @property
    def new_token_ratio(self) -> float: ...
    def start(self, r: Req) -> None: ...
    def start_load(self, r: Req, ticket: LoadTicket) -> None: ...


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """The round's fixed limits: prefill tokens per round, the chunk size, running requests at most,
    and whether a request needs a state slot (the model has recurrent layers)."""

    max_prefill_tokens: int
    chunk_size: int
    max_running: int
    needs_state: bool


def reserve(r: Req, ratio: float) -> int:
    """KV tokens held back for a running request's future: known tokens without a slot yet, plus
    an estimate of the output still to come."""
    rest_new = r.max_new_tokens - r.num_output - 1
    return len(r.tokens) - len(r.kv_slots) + reserve_new_tokens(rest_new, ratio)


@dataclass
class Admission:
    """The admission loop and its budget over the scheduler's waiting queue, retry policy and
    resources (see the module doc). `adder_factory` is replaceable for scripted tests."""

    waiting: WaitingQueue
    retry: RetryPolicy
    res: ReqResources
    metrics: SchedulerMetrics
    limits: AdmissionLimits
    adder_factory: Callable[[AdderBudget], PrefillAdder] = field(default=PrefillAdder)
    lora: LoraSlots = field(default_factory=lambda: LoraSlots(0, enabled=False))

    def budget(self, view: Running, prefill_used: int) -> AdderBudget:
        """The snapshot admission draws from, after running requests took `prefill_used` prefill tokens."""
        ratio = view.new_token_ratio
        reserved = sum(reserve(r, ratio) for r in view.running.values())
        lim = self.limits
        return AdderBudget(
            kv=self.res.available_kv() - reserved,
            states=self.res.available_states(),
            prefill_tokens=lim.max_prefill_tokens - prefill_used,
            running_slots=lim.max_running - len(view.running),
            chunk_size=lim.chunk_size,
            new_token_ratio=ratio,
            needs_state=lim.needs_state,
        )

    def admit(self, view: Running, b: BatchBuilder, prefill_used: int) -> None:
        """Admit waiting requests in queue order into batch `b` until one is refused or deferred."""
        head = self.waiting.peek()
        self.retry.begin_round(view.running_version, not view.running, head.seq if head is not None else None)
        if head is None:
            return
        if not self.retry.should_attempt():
            self.metrics.inc("hyssm_admission_rounds_total", outcome="latched")
            return
        self.metrics.inc("hyssm_admission_rounds_total", outcome="attempted")
        adder = self.adder_factory(self.budget(view, prefill_used))
        res = self.res
        while (r := self.waiting.peek()) is not None:
            peek = res.peek(r)
            if (found := res.find_stored(r, peek)) is not None:
                reason = self._start_load(view, b, adder, r, peek, found)
                if reason:  # an ordinary refusal: the load is tried again, unless nothing runs to free room
                    r.store_checked = not view.running
                    self.record_refusal(r, reason)
                    return
                continue
            self.metrics.inc("hyssm_admission_attempts_total")
            if r.refusals:
                self.metrics.inc("hyssm_admission_retries_total")
            if r.lora is not None and not self.lora.can_place(r.lora):  # a third resource beside KV and states
                self.record_refusal(r, "lora_slot")
                return
            result, grant = adder.add_one_req(r, peek, self._chunk_cap(r, peek))
            if result is AddResult.NO_TOKEN and not view.running and peek.has_state:
                peek = res.fresh_peek(r)  # idle and the hit itself cannot be afforded: start fresh
                result, grant = adder.add_one_req(r, peek, self._chunk_cap(r, peek))
            if result is AddResult.OTHER:
                self.metrics.inc("hyssm_admission_deferred_total", reason=adder.refusal_reason)
                return
            if result is AddResult.NO_TOKEN or grant is None:
                self.record_refusal(r, adder.refusal_reason or "kv")
                return
            try:
                reason = res.start(r, peek, grant.chunk, b)
            except StateCowAllocError as e:  # an ordinary refusal (retry.py), never fatal
                logger.debug("admission of %s refused: %s", r.rid, e)
                reason = "cow_alloc"
            if reason:
                adder.rollback(grant)
                self.record_refusal(r, reason)
                return
            if r.lora is not None and (load := self.lora.place(r.lora)) is not None:
                b.lora_loads.append(load)
            view.start(r)
            if r.queue_s < 0:  # the first admission ends its wait (not one after a retraction)
                r.queue_s = time.monotonic() - r.arrived
            b.add(r, grant.chunk, prefill=True, admitted=True)

    def _start_load(self, view: Running, b: BatchBuilder, adder: PrefillAdder, r: Req, peek: PeekResult,
                    found: StoredPrefix) -> str:  # fmt: skip
        """Start loading `r`'s stored prefix (the request leaves the queue until the load's result);
        "" or the refusal reason, with nothing reserved or taken."""
        kv, states = found.end - found.start + peek.lock_cost_kv, int(self.limits.needs_state)
        if not adder.take(kv, states):
            return adder.refusal_reason
        ticket = self.res.start_load(r, peek, found)
        if isinstance(ticket, str):
            adder.rem_kv += kv
            adder.rem_states += states
            return ticket
        b.add_load(ticket, self.res.store_load_message(ticket, found))
        view.start_load(r, ticket)
        self.metrics.inc("hyssm_state_store_loads_total", result="started")
        return ""

    def _chunk_cap(self, r: Req, peek: PeekResult) -> int:
        """The first chunk ends at the first split point (O(1): asked on every retry)."""
        split = self.res.first_split(r, peek)
        return split - peek.prefix_len if split is not None else len(r.tokens)

    def record_refusal(self, r: Req, reason: str) -> None:
        """Admission of `r` was refused for memory (here, or by a worker refusing its copy-on-write):
        count it and set the full-batch latch."""
        r.refusals += 1
        self.metrics.inc("hyssm_admission_refusals_total", reason=reason)
        self.retry.on_no_token(r.seq)
