"""HybridRadixCache: prefix tree of token segments with KV slots and optional state slots.

Owns the tree's slots (every slot it holds was donated to it and is freed by it) and the two LRU
orders. Rules that must hold:
- a resume point is a node that carries a state (hybrid models) or any node (attention-only models);
  a match never reaches past the deepest resume point, and never past `limit` tokens;
- `peek` never mutates anything (no lock, no LRU touch, no split);
- a KV lock covers the whole path to the root, a state lock only its node; a locked node's KV is never
  evicted and a state-locked node's state is never evicted;
- KV eviction removes unlocked leaves; state eviction deletes an unlocked leaf or tombstones the node;
- `epoch` changes whenever anything a peek result depends on changes (structure, states, lock
  transitions), so a caller may reuse a peek while the epoch is unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from scheduler_proc.radix_check import check_tree
from scheduler_proc.radix_node import LruHeap, TreeNode, common_prefix_len
from shared.errors import StateCowAllocError

logger = logging.getLogger(__name__)

KEEP_BONUS = 1 << 24  # LRU head start (in clock ticks) of a retracted request's saved progress


class Allocator(Protocol):
    @property
    def num_free(self) -> int: ...
    def alloc(self) -> int | None: ...
    def alloc_many(self, n: int) -> list[int] | None: ...
    def free(self, slot: int) -> None: ...
    def free_many(self, slots: list[int]) -> None: ...


@dataclass(frozen=True, slots=True)
class PeekResult:
    """What admitting `tokens` now would get. `lock_cost_kv`/`state_lock_cost`: evictable KV tokens and
    states that locking this match would take out of the evictable pool."""

    node: TreeNode
    prefix_len: int  # tokens served from the cache (the resume point's end)
    kv_len: int  # tokens whose KV the tree holds (>= prefix_len; more = a branch point)
    lock_cost_kv: int
    state_lock_cost: int
    epoch: int

    @property
    def has_state(self) -> bool:
        return self.node.state is not None


@dataclass(slots=True)
class CowMatch:
    """A locked match. The holder owns one KV lock on `node`'s path and, when `src_state` is set, one
    state lock on `node` until the worker has run the copy src_state -> dst_state."""

    node: TreeNode
    prefix_len: int
    prefix_kv: list[int]
    src_state: int | None
    dst_state: int | None


class HybridRadixCache:
    def __init__(self, kv_alloc: Allocator, state_alloc: Allocator, track_states: bool = True) -> None:
        self.kv_alloc = kv_alloc
        self.state_alloc = state_alloc
        self.track_states = track_states
        self._next_id = 1
        self.root = TreeNode(0, None, [], [], 0)
        self._nodes: dict[int, TreeNode] = {}
        self._clock = 0
        self.epoch = 0
        self.kv_total = 0
        self.kv_evictable = 0
        self.states_total = 0
        self.states_evictable = 0
        self.num_locked_nodes = 0
        # called with a node whose state (or, without states, whose KV) eviction is about to drop,
        # while its slots still hold it (the state store's write-back)
        self.on_evict: Callable[[TreeNode], None] | None = None
        live = self._nodes.values
        self._kv_lru = LruHeap(lambda n: not n.children and n.kv_lock == 0, self._alive, live)
        self._state_lru = LruHeap(lambda n: n.state is not None and n.state_lock == 0, self._alive, live)

    def _alive(self, node: TreeNode) -> bool:
        return self._nodes.get(node.nid) is node

    @property
    def num_nodes(self) -> int:
        return len(self._nodes)

    # ------------------------------------------------------------------ matching
    def peek(self, tokens: list[int], limit: int) -> PeekResult:
        """Deepest resume point for tokens[:limit]; mutates nothing."""
        node, pos, cost = self.root, 0, 0
        best, best_cost = self.root, 0
        while pos < limit:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            m = common_prefix_len(tokens, pos, limit, child.key)
            pos += m
            if m < len(child.key):
                break
            node = child
            if child.kv_lock == 0:
                cost += len(child.kv)
            if child.state is not None or not self.track_states:
                best, best_cost = child, cost
        state_cost = int(best.state is not None and best.state_lock == 0)
        return PeekResult(best, best.end, pos, best_cost, state_cost, self.epoch)

    def match_and_cow(self, tokens: list[int], limit: int, peek: PeekResult | None = None) -> CowMatch:
        """Lock the deepest resume point and, when it carries a state, allocate the holder's private
        copy-on-write slot (evicting unlocked states if needed). Raises StateCowAllocError when no slot
        can be had; then every lock taken here is released again and no slot is assigned."""
        if peek is None or peek.epoch != self.epoch:
            peek = self.peek(tokens, limit)
        node = peek.node
        self.lock(node)
        if node.state is None or not self.track_states:
            return CowMatch(node, node.end, self.path_kv(node), None, None)
        self.lock_state(node)
        dst = self.alloc_state()
        if dst is None:
            self.unlock_state(node)
            self.unlock(node)
            raise StateCowAllocError(f"no state slot for a copy-on-write of node {node.nid}")
        return CowMatch(node, node.end, self.path_kv(node), node.state, dst)

    def path_tokens(self, node: TreeNode) -> list[int]:
        parts: list[list[int]] = []
        while node is not self.root:
            parts.append(node.key)
            node = node.parent  # type: ignore[assignment]
        return [t for part in reversed(parts) for t in part]

    def path_kv(self, node: TreeNode) -> list[int]:
        parts: list[list[int]] = []
        while node is not self.root:
            parts.append(node.kv)
            node = node.parent  # type: ignore[assignment]
        out: list[int] = []
        for part in reversed(parts):
            out.extend(part)
        return out

    def unkeep(self, tokens: list[int], limit: int) -> None:
        """End the eviction head start of a retracted request's progress (it was aborted while waiting):
        every node of the KV path of tokens[:limit], also past the deepest state (a kept node may
        have been tombstoned since)."""
        node, pos = self.root, 0
        while pos < limit:
            child = node.children.get(tokens[pos])
            if child is None or common_prefix_len(tokens, pos, limit, child.key) < len(child.key):
                break
            node, pos = child, pos + len(child.key)
        now = self._clock
        while node is not self.root:
            if node.last_access > now:
                self._touch(node, now)
            node = node.parent  # type: ignore[assignment]

    # ------------------------------------------------------------------ locks
    def lock(self, node: TreeNode) -> None:
        self._clock += 1
        now, changed = self._clock, False
        while node is not self.root:
            if node.kv_lock == 0:
                self.kv_evictable -= len(node.kv)
                self.num_locked_nodes += 1
                changed = True
            node.kv_lock += 1
            node.last_access = now
            if node.state is not None and node.state_lock == 0:
                self._state_lru.push(node)  # its access time changed
            node = node.parent  # type: ignore[assignment]
        if changed:
            self.epoch += 1

    def unlock(self, node: TreeNode) -> None:
        changed = False
        while node is not self.root:
            if node.kv_lock <= 0:
                raise AssertionError(f"unlock of unlocked {node}")
            node.kv_lock -= 1
            if node.kv_lock == 0:
                self.kv_evictable += len(node.kv)
                self.num_locked_nodes -= 1
                changed = True
                if not node.children:
                    self._kv_lru.push(node)
            node = node.parent  # type: ignore[assignment]
        if changed:
            self.epoch += 1

    def lock_state(self, node: TreeNode) -> None:
        if node.state is None:
            raise AssertionError(f"state lock of a tombstone {node}")
        if node.state_lock == 0:
            self.states_evictable -= 1
            self.epoch += 1
        node.state_lock += 1

    def unlock_state(self, node: TreeNode) -> None:
        if node.state_lock <= 0:
            raise AssertionError(f"state unlock of {node}")
        node.state_lock -= 1
        if node.state_lock == 0:
            self.states_evictable += 1
            self._state_lru.push(node)
            self.epoch += 1

    # ------------------------------------------------------------------ allocation with eviction
    def alloc_kv(self, n: int) -> list[int] | None:
        short = n - self.kv_alloc.num_free
        if short > 0:
            self.evict_kv(short)
        return self.kv_alloc.alloc_many(n)

    def alloc_state(self) -> int | None:
        if self.state_alloc.num_free < 1:
            self.evict_states(1)
        return self.state_alloc.alloc()

    # ------------------------------------------------------------------ insertion (donation)
    def insert(
        self, tokens: list[int], length: int, kv: list[int], owned_from: int, state: int | None, keep: bool = False
    ) -> TreeNode:
        """Donate tokens[:length] with KV slots kv[:length] and (optionally) the state after them.

        kv[:owned_from] are the tree's own slots (the caller holds a lock on that path); kv[owned_from:
        length] and `state` belong to the caller and pass to the tree: slots for positions the tree
        already holds, and a state where the end node already has one, are freed here. Returns the node
        that ends at `length` (the root for length 0); the caller re-reads its prefix with path_kv.
        `keep`: the progress of a retracted request that will resume; its path is evicted after every
        ordinary entry (its access time is set KEEP_BONUS ahead) until something locks it again."""
        self._clock += 1
        now, node, pos = self._clock + (KEEP_BONUS if keep else 0), self.root, 0
        while pos < length:
            child = node.children.get(tokens[pos])
            if child is None:
                if pos < owned_from:
                    raise AssertionError(f"insert: caller-locked prefix missing at position {pos}")
                child = self._add_leaf(node, tokens[pos:length], kv[pos:length], now)
                pos = length
                node = child
                break
            m = common_prefix_len(tokens, pos, length, child.key)
            if m < len(child.key):
                child = self._split(child, m)
            lo = max(pos, owned_from)
            if lo < pos + m:
                self.kv_alloc.free_many(kv[lo : pos + m])
            self._touch(child, now)
            node, pos = child, pos + m
        if state is not None:
            if node is self.root or node.state is not None or not self.track_states:
                self.state_alloc.free(state)
            else:
                self._set_state(node, state)
        return node

    def _add_leaf(self, parent: TreeNode, key: list[int], kv: list[int], now: int) -> TreeNode:
        leaf = TreeNode(self._next_id, parent, key, kv, parent.end + len(key))
        self._next_id += 1
        leaf.last_access = now
        parent.children[key[0]] = leaf
        self._nodes[leaf.nid] = leaf
        self.kv_total += len(kv)
        self.kv_evictable += len(kv)
        self._kv_lru.push(leaf)
        self.epoch += 1
        return leaf

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Cut `child` after m tokens; returns the new upper node (a tombstone ending at start + m)."""
        parent = child.parent
        assert parent is not None and 0 < m < len(child.key)
        upper = TreeNode(self._next_id, parent, child.key[:m], child.kv[:m], child.start + m)
        self._next_id += 1
        upper.kv_lock = child.kv_lock
        upper.last_access = child.last_access
        upper.children[child.key[m]] = child
        parent.children[upper.key[0]] = upper
        child.key, child.kv, child.parent = child.key[m:], child.kv[m:], upper
        self._nodes[upper.nid] = upper
        if upper.kv_lock > 0:
            self.num_locked_nodes += 1
        self.epoch += 1
        return upper

    def _touch(self, node: TreeNode, now: int) -> None:
        node.last_access = now
        if node.state is not None and node.state_lock == 0:
            self._state_lru.push(node)
        if not node.children and node.kv_lock == 0:
            self._kv_lru.push(node)

    def _set_state(self, node: TreeNode, slot: int) -> None:
        node.state = slot
        self.states_total += 1
        if node.state_lock == 0:
            self.states_evictable += 1
            self._state_lru.push(node)
        self.epoch += 1

    # ------------------------------------------------------------------ eviction
    def evict_kv(self, n: int) -> int:
        """Free at least `n` KV tokens by deleting unlocked leaves in LRU order (fewer if it runs out)."""
        return self._evict(self._kv_lru, n, self._evict_leaf)

    def evict_states(self, n: int) -> int:
        """Free up to `n` state slots in LRU order: an unlocked leaf is deleted, any other node tombstoned."""
        return self._evict(self._state_lru, n, self._evict_state)

    @staticmethod
    def _evict(lru: LruHeap, n: int, evict_one: Callable[[TreeNode], int]) -> int:
        """Pop candidates from `lru` until `evict_one` (which returns what it freed) reached `n`."""
        freed = 0
        while freed < n and (node := lru.pop()) is not None:
            freed += evict_one(node)
        return freed

    def _evict_leaf(self, node: TreeNode) -> int:
        if self.on_evict is not None:
            self.on_evict(node)
        freed = len(node.kv)
        self._delete_leaf(node)
        return freed

    def _evict_state(self, node: TreeNode) -> int:
        if self.on_evict is not None:
            self.on_evict(node)
        if not node.children and node.kv_lock == 0:
            self._delete_leaf(node)
        else:
            self._clear_state(node)
        return 1

    def drop_state(self, node: TreeNode, slot: int) -> bool:
        """Tombstone `node` if it still holds `slot` unlocked (a checkpoint whose copy never ran)."""
        if not self._alive(node) or node.state != slot or node.state_lock:
            return False
        self._clear_state(node)
        return True

    def flush(self) -> int:
        """Drop every unlocked node and every unlocked state; returns the number of slots freed."""
        before = self.kv_total + self.states_total
        self.evict_kv(self.kv_total + 1)
        self.evict_states(self.states_total + 1)
        return before - (self.kv_total + self.states_total)

    def _delete_leaf(self, node: TreeNode) -> None:
        assert not node.children and node.kv_lock == 0 and node.state_lock == 0, node
        self.kv_alloc.free_many(node.kv)
        self.kv_total -= len(node.kv)
        self.kv_evictable -= len(node.kv)
        if node.state is not None:
            self._clear_state(node)
        parent = node.parent
        assert parent is not None
        del parent.children[node.key[0]]
        del self._nodes[node.nid]
        node.parent = None
        if parent is not self.root and not parent.children and parent.kv_lock == 0:
            self._kv_lru.push(parent)
        self.epoch += 1

    def _clear_state(self, node: TreeNode) -> None:
        assert node.state is not None and node.state_lock == 0, node
        self.state_alloc.free(node.state)
        node.state = None
        self.states_total -= 1
        self.states_evictable -= 1
        self.epoch += 1

    # ------------------------------------------------------------------ introspection
    def nodes(self) -> list[TreeNode]:
        return list(self._nodes.values())

    def held_kv(self) -> list[int]:
        return [slot for node in self._nodes.values() for slot in node.kv]

    def held_states(self) -> list[int]:
        return [node.state for node in self._nodes.values() if node.state is not None]

    def direct_kv_holds(self, node: TreeNode) -> int:
        """Holders whose lock ends exactly at `node` (its lock count minus its children's)."""
        return node.kv_lock - sum(c.kv_lock for c in node.children.values())

    def check_integrity(self) -> None:
        counters = {"kv_total": self.kv_total, "kv_evictable": self.kv_evictable, "states_total": self.states_total,
                    "states_evictable": self.states_evictable, "num_locked_nodes": self.num_locked_nodes}  # fmt: skip
        check_tree(self.root, self._nodes, self.track_states, counters)
