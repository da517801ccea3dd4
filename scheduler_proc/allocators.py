"""Slot allocators for the two scarce worker resources: attention KV token slots and state slots.

The scheduler owns slot *ids*; workers own the tensors those ids index. Slot 0 is the workers' padding
slot and is never handed out, so usable ids are 1..capacity. Allocation and freeing are O(1) per slot
(a LIFO free stack plus a membership bitmap); `alloc_many` is all-or-nothing and hands out
consecutive ids in ascending order while the stack holds them so.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class SlotAllocator:
    """Free-list allocator of integer slot ids 1..capacity.

    Rule: a slot is either in the free stack (and flagged free) or handed out, never both; freeing a
    slot that is already free, or an id out of range, raises immediately (a double free is a bug that
    would let two owners write one slot).
    """

    kind = "slot"

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"{self.kind} capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        # reversed so that low ids come out first (deterministic, easy to read in tests)
        self._free: list[int] = list(range(capacity, 0, -1))
        self._is_free = bytearray(b"\x01" * (capacity + 1))
        self._is_free[0] = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def is_free(self, slot: int) -> bool:
        return bool(self._is_free[slot])

    def alloc(self) -> int | None:
        """One slot, or None when none is free."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._is_free[slot] = 0
        return slot

    def alloc_many(self, n: int) -> list[int] | None:
        """`n` slots, or None (and nothing taken) when fewer than `n` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} {self.kind}s")
        if n > len(self._free):
            return None
        if n == 0:
            return []
        slots = self._free[-n:]
        del self._free[-n:]
        flags = self._is_free
        for slot in slots:
            flags[slot] = 0
        slots.reverse()
        return slots

    def free(self, slot: int) -> None:
        if not 0 < slot <= self.capacity:
            raise ValueError(f"{self.kind} {slot} out of range 1..{self.capacity}")
        if self._is_free[slot]:
            raise ValueError(f"double free of {self.kind} {slot}")
        self._is_free[slot] = 1
        self._free.append(slot)

    def free_many(self, slots: list[int]) -> None:
        """Free `slots`; the next `alloc_many` hands them out again in the order given (the stack takes
        them last first). A context freed as one ascending run of KV slots comes back as that run, which
        CPU attention reads in place instead of gathering it per layer and step."""
        for slot in reversed(slots):
            self.free(slot)

    def check_integrity(self) -> None:
        free = self._free
        assert len(set(free)) == len(free), f"{self.kind} free list has duplicates"
        assert all(0 < s <= self.capacity for s in free), f"{self.kind} free list has an out-of-range id"
        flagged = sum(self._is_free)
        assert flagged == len(free), f"{self.kind}: {flagged} flagged free but {len(free)} in the free list"
        assert all(self._is_free[s] for s in free), f"{self.kind} free list and bitmap disagree"


class KVAllocator(SlotAllocator):
    """Attention KV token slots (one per token position of one request or tree node)."""

    kind = "kv slot"


class StateSlotAllocator(SlotAllocator):
    """state slots (conv + SSM state of one sequence position boundary)."""

    kind = "state slot"
