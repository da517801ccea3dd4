"""RetryPolicy: when admission of the waiting queue is tried again after a refusal for memory.

The rule this engine exists for: a request never stays queued after the capacity it waits for has
come back, and running out of memory is never fatal. Concretely:
- admission is refused for memory (`AddResult.NO_TOKEN`, a failed state or KV allocation, a
  copy-on-write allocation failure `StateCowAllocError`, a worker refusing the copy) or for want of a
  LoRA adapter slot (every slot pinned by a running request: lora_slots.py) -> the request
  keeps its place in the queue, holds nothing, and the full-batch latch is set; a CoW allocation
  failure is an ordinary refusal like the others, never an error or a crash;
- the latch is cleared as soon as capacity may have come back. For hybrid SSM models with a
  state-caching radix cache that can happen without the running batch changing (a lock released,
  a state donated or made evictable), so the latch is cleared every round; likewise with priority
  preemption and with hybrid sliding-window attention. Otherwise (radix cache disabled,
  attention-only model) capacity only returns when the running batch changes (`running_version`,
  bumped by `Scheduler.transition`; an adapter slot is unpinned only then too), and the latch waits for
  that -- or for a different head: the refusal was about one request, so when it leaves the queue
  (aborted) or another overtakes it (priority), the new head is tried at once. With nothing running the
  latch is always cleared;
- a retry of an unchanged request costs O(1): its cache match is reused while the cache epoch is
  unchanged (`ReqResources.peek`) and its first chunk is capped in O(1) (`ReqResources.first_split`).
"""

from __future__ import annotations

from shared.config import ServerArgs
from shared.model_info import ModelInfo


class RetryPolicy:
    """Owns the full-batch latch (`batch_is_full`): "the head of the queue cannot be admitted until
    something changes". `begin_round` once per round before admission, `on_no_token` per refusal."""

    def __init__(self, clear_every_round: bool) -> None:
        self.clear_every_round = clear_every_round
        self.batch_is_full = False
        self._seen_running_version = -1
        self._refused_head: int | None = None  # key of the request whose refusal set the latch

    @staticmethod
    def for_config(args: ServerArgs, model: ModelInfo, sliding_window: bool = False) -> RetryPolicy:
        """`sliding_window`: the model has hybrid sliding-window attention layers (ModelInfo of the
        supported architectures has none; the caller says so when it knows better)."""
        state_cache = model.has_recurrent_state and not args.disable_radix_cache
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
