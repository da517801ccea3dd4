"""PrefillAdder: the per-round admission budget, and RetryPolicy: when admission is tried again.

The adder is pure arithmetic over a snapshot the Scheduler takes once per round; it never allocates or
touches the cache. Rule: the Scheduler asks the adder *before* it locks, allocates or copies anything
for a request, and calls `rollback` if a later step (the copy-on-write allocation) fails, so a refused
admission leaves no trace in the budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from shared.config import ServerArgs
from shared.model_info import ModelInfo


class AddResult(Enum):
    CONTINUE = "continue"  # admitted; try the next request
    NO_TOKEN = "no_token"  # out of memory (KV tokens or Mamba state slots): sets the full-batch latch
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

    def rollback(self, grant: Grant) -> None:
        """Undo a grant whose admission failed after the budget check (e.g. MambaCowAllocError)."""
        self.granted.remove(grant)
        self.rem_kv += grant.kv
        self.rem_states += grant.states
        self.rem_prefill += grant.chunk
        self.rem_running += 1


class RetryPolicy:
    """Owns the full-batch latch (`batch_is_full`), set when admission is refused for memory.

    The latch says "the head of the queue cannot be admitted until something changes". For hybrid SSM
    models with a state-caching radix cache, cached states become evictable (a lock released, a state
    donated) without the running batch changing, so the latch is cleared every round; likewise with
    priority preemption and hybrid sliding-window attention. Otherwise (radix cache disabled,
    attention-only model) capacity only returns when the running batch changes, and the latch waits
    for that -- or for a different head: the refusal was about one request, so when it leaves the
    queue (aborted) or another overtakes it (priority), the new head is tried at once.
    """

    def __init__(self, clear_every_round: bool) -> None:
        self.clear_every_round = clear_every_round
        self.batch_is_full = False
        self._seen_running_version = -1
        self._refused_head: int | None = None  # key of the request whose refusal set the latch

    @staticmethod
    def for_config(args: ServerArgs, model: ModelInfo, sliding_window: bool = False) -> RetryPolicy:
        """`sliding_window`: the model has hybrid sliding-window attention layers (ModelInfo of the
        supported architectures has none; the caller says so when it knows better)."""
        state_cache = model.has_mamba and not args.disable_radix_cache
        return RetryPolicy(state_cache or args.enable_priority_preemption or sliding_window)

    def begin_round(self, running_version: int, running_empty: bool, head: int | None = None) -> None:
        """Clear the latch if this configuration retries every round, the running batch changed, or
        the head of the queue (`head`: its key, None when unknown) is not the request that was refused.
        With nothing running nothing else can change, so the latch is cleared as well."""
        changed = running_version != self._seen_running_version
        self._seen_running_version = running_version
        new_head = head is not None and head != self._refused_head
        if self.clear_every_round or changed or running_empty or new_head:
            self.batch_is_full = False

    def should_attempt(self) -> bool:
        return not self.batch_is_full

    def on_no_token(self, head: int | None = None) -> None:
        """Admission of the request keyed `head` was refused for memory."""
        self.batch_is_full = True
        self._refused_head = head
