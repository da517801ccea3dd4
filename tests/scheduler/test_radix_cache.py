"""Unit tests of HybridRadixCache with real allocators (and one stubbed allocator for the CoW error)."""

from __future__ import annotations

import pytest

from scheduler_proc.allocators import KVAllocator, StateSlotAllocator
from scheduler_proc.radix_cache import HybridRadixCache
from shared.errors import StateCowAllocError


def make(kv: int = 64, states: int = 4, track: bool = True) -> HybridRadixCache:
    return HybridRadixCache(KVAllocator(kv), StateSlotAllocator(states), track)


def donate(c: HybridRadixCache, tokens: list[int], with_state: bool = True) -> None:
    """Insert tokens the way a finished request would (all slots its own)."""
    kv = c.kv_alloc.alloc_many(len(tokens))
    assert kv is not None
    state = c.state_alloc.alloc() if with_state else None
    c.insert(tokens, len(tokens), kv, 0, state)


def test_match_stops_at_deepest_state_and_caps_at_limit() -> None:
    c = make()
    donate(c, [1, 2, 3, 4, 5, 6])
    donate(c, [1, 2, 3, 9, 9])  # splits [1,2,3] off as a tombstone
    p = c.peek([1, 2, 3, 4, 5, 6, 7], 6)
    assert (p.prefix_len, p.kv_len, p.has_state) == (6, 6, True)
    # the limit (prompt length - 1) stops the match before the node carrying the state ends
    p = c.peek([1, 2, 3, 4, 5, 6], 5)
    assert (p.prefix_len, p.kv_len, p.node is c.root) == (0, 5, True)
    # KV matches through the tombstone [1,2,3] into [4,5,6] but no state is reachable: a branch point
    p = c.peek([1, 2, 3, 4, 8, 8], 5)
    assert (p.prefix_len, p.kv_len) == (0, 4)
    c.check_integrity()


def test_attention_only_cache_resumes_at_any_node() -> None:
    c = make(track=False)
    donate(c, [1, 2, 3, 4], with_state=False)
    donate(c, [1, 2, 7], with_state=False)
    p = c.peek([1, 2, 3, 4, 5], 4)
    assert p.prefix_len == 4
    p = c.peek([1, 2, 3, 9], 3)
    assert p.prefix_len == 2 and p.kv_len == 3
    c.check_integrity()


def test_peek_does_not_mutate() -> None:
    c = make()
    donate(c, [1, 2, 3, 4])
    before = (c.epoch, c._clock, [(n.nid, n.last_access, n.kv_lock, len(n.key)) for n in c.nodes()])
    c.peek([1, 2, 3, 4, 5], 4)
    c.peek([1, 2, 9], 2)  # would need a split to insert; a peek must not split
    after = (c.epoch, c._clock, [(n.nid, n.last_access, n.kv_lock, len(n.key)) for n in c.nodes()])
    assert before == after


def test_locks_path_and_state_and_counters() -> None:
    c = make()
    donate(c, [1, 2, 3])
    donate(c, [1, 2, 3, 4, 5])
    m = c.match_and_cow([1, 2, 3, 4, 5, 6], 5)
    assert m.prefix_len == 5 and m.src_state is not None and m.dst_state is not None
    assert m.prefix_kv == c.path_kv(m.node)
    upper = m.node.parent
    assert upper is not None and upper.kv_lock == 1 and m.node.kv_lock == 1 and m.node.state_lock == 1
    assert upper.state_lock == 0  # state lock only on the matched node
    assert c.kv_evictable == 0 and c.states_evictable == 1 and c.num_locked_nodes == 2
    c.check_integrity()
    c.unlock_state(m.node)
    c.unlock(m.node)
    c.state_alloc.free(m.dst_state)
    assert c.kv_evictable == 5 and c.states_evictable == 2 and c.num_locked_nodes == 0
    c.check_integrity()


def test_kv_eviction_lru_leaves_only_and_never_locked() -> None:
    c = make(kv=12, states=4)
    donate(c, [1, 2, 3, 4])  # A
    donate(c, [1, 2, 5, 6])  # B, splits [1,2]
    donate(c, [7, 8, 9])  # C
    m = c.match_and_cow([1, 2, 5, 6, 0], 4)  # lock B's path
    c.unlock_state(m.node)
    c.state_alloc.free(m.dst_state)  # type: ignore[arg-type]
    c.peek([1, 2, 3, 4, 0], 4)  # a peek does not refresh A
    freed = c.evict_kv(1)  # LRU unlocked leaf: A's [3,4] (older than C)
    assert freed == 2
    assert c.peek([1, 2, 3, 4, 0], 4).kv_len == 2
    assert c.peek([7, 8, 9, 0], 3).prefix_len == 3
    assert c.evict_kv(100) == 3  # C only: B and [1,2] are locked
    assert c.peek([1, 2, 5, 6, 0], 4).prefix_len == 4
    c.unlock(m.node)
    assert c.evict_kv(100) == 4 and c.num_nodes == 0
    assert c.kv_alloc.num_free == 12 and c.state_alloc.num_free == 4
    c.check_integrity()


def test_state_eviction_tombstones_inner_and_deletes_leaf() -> None:
    c = make(kv=32, states=4)
    donate(c, [1, 2, 3])
    donate(c, [1, 2, 3, 4, 5])
    inner = c.peek([1, 2, 3, 0], 3).node
    leaf = c.peek([1, 2, 3, 4, 5, 0], 5).node
    assert c.evict_states(1) == 1  # inner [1,2,3] is older: tombstoned, keeps its KV
    assert inner.state is None and c.num_nodes == 2 and c.kv_total == 5
    assert c.peek([1, 2, 3, 0], 3).prefix_len == 0
    assert c.evict_states(1) == 1  # the leaf is deleted with its KV
    assert leaf.parent is None and c.kv_total == 3 and c.states_total == 0
    c.check_integrity()


def test_state_eviction_spares_locked_states_and_tombstones_kv_locked_nodes() -> None:
    c = make(kv=32, states=4)
    donate(c, [1, 2, 3])
    donate(c, [1, 2, 3, 4, 5])
    m = c.match_and_cow([1, 2, 3, 4, 5, 6], 5)  # locks leaf state; [1,2,3] KV-locked only
    assert c.evict_states(4) == 1  # only [1,2,3]'s state may go, as a tombstone (it is KV-locked)
    assert m.node.state is not None and c.num_nodes == 2
    c.check_integrity()


def test_donation_dedups_kv_and_states() -> None:
    c = make(kv=16, states=4)
    donate(c, [1, 2, 3, 4])
    free_before = c.kv_alloc.num_free
    # a request that matched nothing computed [1,2,3,4,5] in its own slots: 4 are duplicates
    kv = c.kv_alloc.alloc_many(5)
    st = c.state_alloc.alloc()
    node = c.insert([1, 2, 3, 4, 5], 5, kv, 0, st)  # type: ignore[arg-type]
    assert node.end == 5 and node.state == st
    assert c.kv_alloc.num_free == free_before - 1
    # same sequence again: the state is a duplicate too and is freed
    kv = c.kv_alloc.alloc_many(5)
    st2 = c.state_alloc.alloc()
    c.insert([1, 2, 3, 4, 5], 5, kv, 0, st2)  # type: ignore[arg-type]
    assert c.state_alloc.is_free(st2)  # type: ignore[arg-type]
    assert c.kv_alloc.num_free == free_before - 1 and c.states_total == 2
    c.check_integrity()


def test_insert_keeps_callers_tree_prefix() -> None:
    c = make(kv=16, states=4)
    donate(c, [1, 2, 3])
    m = c.match_and_cow([1, 2, 3, 4], 3)
    c.unlock_state(m.node)
    own = c.kv_alloc.alloc_many(2)
    assert own is not None
    kv = m.prefix_kv + own
    node = c.insert([1, 2, 3, 4, 5], 5, kv, m.prefix_len, m.dst_state)
    assert c.path_kv(node) == kv and node.state == m.dst_state
    c.unlock(m.node)
    c.check_integrity()


class _EmptyStateAllocator:
    """An allocator with no free slot; counts alloc calls."""

    num_free = 0

    def __init__(self) -> None:
        self.alloc_calls = 0

    def alloc(self) -> int | None:
        self.alloc_calls += 1
        return None

    def alloc_many(self, n: int) -> list[int] | None:
        return None if n else []

    def free(self, slot: int) -> None:
        raise AssertionError("nothing to free")

    def free_many(self, slots: list[int]) -> None:
        raise AssertionError("nothing to free")


def test_cow_alloc_error_balanced_locks_and_no_slot() -> None:
    states = _EmptyStateAllocator()
    c = HybridRadixCache(KVAllocator(16), states, True)
    kv = c.kv_alloc.alloc_many(3)
    c.insert([1, 2, 3], 3, kv, 0, 7)  # type: ignore[arg-type]  # a cached state in slot 7
    calls: dict[str, int] = {"lock": 0, "unlock": 0, "lock_state": 0, "unlock_state": 0}
    for name in calls:
        original = getattr(c, name)

        def spy(node: object, _name: str = name, _orig: object = original) -> None:
            calls[_name] += 1
            _orig(node)  # type: ignore[operator]

        setattr(c, name, spy)
    evictions: list[int] = []
    c.evict_states = lambda n: evictions.append(n) or 0  # type: ignore[method-assign]
    with pytest.raises(StateCowAllocError):
        c.match_and_cow([1, 2, 3, 4], 3)
    assert evictions == [1] and states.alloc_calls == 1
    assert calls["lock"] == calls["unlock"] == 1 and calls["lock_state"] == calls["unlock_state"] == 1
    node = c.peek([1, 2, 3, 4], 3).node
    assert node.kv_lock == 0 and node.state_lock == 0 and node.state == 7
    assert c.kv_evictable == 3 and c.states_evictable == 1 and c.num_locked_nodes == 0
    c.check_integrity()


def test_flush_drops_unlocked_only() -> None:
    c = make()
    donate(c, [1, 2, 3])
    donate(c, [4, 5, 6])
    m = c.match_and_cow([4, 5, 6, 7], 3)
    c.unlock_state(m.node)
    assert c.flush() == 5  # [1,2,3] with its state, and the (unlocked) state of the KV-locked [4,5,6]
    p = c.peek([4, 5, 6, 7], 3)
    assert p.prefix_len == 0 and p.kv_len == 3 and c.kv_total == 3
    c.unlock(m.node)
    c.flush()
    assert c.num_nodes == 0 and c.kv_alloc.num_free == 64 and c.state_alloc.num_free == 3
    c.check_integrity()


def test_integrity_check_catches_a_bad_counter() -> None:
    c = make()
    donate(c, [1, 2, 3])
    c.kv_evictable += 1
    with pytest.raises(AssertionError, match="kv_evictable"):
        c.check_integrity()


def test_kept_progress_is_evicted_last_until_unkept() -> None:
    c = make(kv=16, states=4)
    kv = c.kv_alloc.alloc_many(3)
    c.insert([1, 2, 3], 3, kv, 0, c.state_alloc.alloc(), keep=True)  # type: ignore[arg-type]
    donate(c, [4, 5, 6])  # newer, but ordinary
    assert c.evict_kv(1) == 3 and c.peek([1, 2, 3, 0], 3).prefix_len == 3
    assert c.peek([4, 5, 6, 0], 3).prefix_len == 0
    donate(c, [7, 8, 9])
    c.unkeep([1, 2, 3, 0], 3)  # now an ordinary entry: older than [7, 8, 9]
    c.evict_kv(1)
    assert c.peek([1, 2, 3, 0], 3).prefix_len == 0 and c.peek([7, 8, 9, 0], 3).prefix_len == 3
    c.check_integrity()


def test_lru_heaps_stay_bounded_without_eviction() -> None:
    """Every lock, unlock and touch pushes an LRU entry; with memory to spare nothing is ever evicted,
    so the heaps must compact on their own instead of growing with the number of requests served."""
    c = make(kv=64, states=8)
    donate(c, [1, 2, 3])
    donate(c, [1, 2, 3, 4, 5])  # two state-carrying nodes on one path
    for _ in range(20_000):
        m = c.match_and_cow([1, 2, 3, 4, 5, 6], 5)
        c.unlock_state(m.node)
        c.unlock(m.node)
        c.state_alloc.free(m.dst_state)  # type: ignore[arg-type]
    assert len(c._state_lru) <= 4 * c.num_nodes + 1025 and len(c._kv_lru) <= 4 * c.num_nodes + 1025
    assert c.evict_states(8) == 2 and c.kv_total == 3 and c.evict_kv(64) == 3 and c.num_nodes == 0  # still complete
    c.check_integrity()


def test_unkeep_reaches_kept_nodes_past_the_deepest_state() -> None:
    """A retracted request's kept path may have lost the state at its end (tombstoned under state
    pressure while another request's prompt KV extends it). Unkeeping must still end the head start of
    the whole path, not only of the part up to the deepest remaining state."""
    c = make(kv=32, states=4)
    donate(c, [1, 2, 3, 4, 5, 6], with_state=False)  # a prompt's KV shared while it decodes, older
    kv = c.kv_alloc.alloc_many(4)
    c.insert([1, 2, 3, 4], 4, kv, 0, c.state_alloc.alloc(), keep=True)  # type: ignore[arg-type]  # splits
    kept = c.peek([1, 2, 3, 4, 0], 4).node
    assert c.evict_states(1) == 1 and kept.state is None and kept.children  # tombstoned, still kept
    donate(c, [7, 8, 9])  # newer, ordinary
    c.unkeep([1, 2, 3, 4, 0], 4)  # the request was aborted while waiting
    assert c.evict_kv(2) == 2 and c.peek([1, 2, 3, 4, 5, 6, 0], 6).kv_len == 4  # the leaf [5, 6]
    assert c.evict_kv(1) == 4  # then [1, 2, 3, 4], older than [7, 8, 9] once unkept
    assert c.peek([7, 8, 9, 0], 3).prefix_len == 3
    c.check_integrity()
