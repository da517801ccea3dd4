from __future__ import annotations

import pytest

from scheduler_proc.allocators import KVAllocator, StateSlotAllocator


def test_alloc_free_roundtrip_and_padding_slot_never_given() -> None:
    a = KVAllocator(5)
    got = a.alloc_many(5)
    assert got is not None and sorted(got) == [1, 2, 3, 4, 5]
    assert a.num_free == 0 and a.alloc() is None and a.alloc_many(1) is None
    a.free_many(got[:2])
    assert a.num_free == 2
    a.check_integrity()


def test_a_freed_run_of_slots_comes_back_as_the_same_ascending_run() -> None:
    """A long prompt's chunks take their KV slots one after another; once its cached context is evicted
    (freed leaf first, each node's slots in order), the next prompt's chunks get one ascending run again."""
    a = KVAllocator(64)
    first = [a.alloc_many(16) for _ in range(3)]
    assert sum(first, []) == list(range(1, 49))
    for part in reversed(first):  # eviction frees the deepest node first
        a.free_many(part)
    again = [a.alloc_many(16) for _ in range(3)]
    assert sum(again, []) == list(range(1, 49))
    a.check_integrity()


def test_alloc_many_is_all_or_nothing() -> None:
    a = StateSlotAllocator(3)
    assert a.alloc() == 1
    assert a.alloc_many(3) is None
    assert a.num_free == 2
    assert a.alloc_many(0) == []
    assert a.alloc_many(2) == [2, 3]
    a.check_integrity()


def test_double_free_and_out_of_range_raise() -> None:
    a = KVAllocator(2)
    s = a.alloc()
    assert s is not None
    a.free(s)
    with pytest.raises(ValueError, match="double free"):
        a.free(s)
    with pytest.raises(ValueError, match="out of range"):
        a.free(0)
    with pytest.raises(ValueError, match="out of range"):
        a.free(3)
    a.check_integrity()


def test_integrity_detects_corruption() -> None:
    a = KVAllocator(3)
    a._free.append(a._free[-1])  # corrupt: duplicate in the free list
    with pytest.raises(AssertionError, match="duplicates"):
        a.check_integrity()
