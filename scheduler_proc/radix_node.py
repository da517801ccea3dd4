"""Tree node of the hybrid radix cache and the lazy LRU heap used for both eviction orders.

A node owns a token segment, one KV slot per token, and optionally the state slot that holds the
recurrent state after the node's last token (a node without one is a *tombstone*: its KV can be reused
but it is not a resume point). Lock counts are kept per node; the cache (radix_cache.py) maintains them.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection


class TreeNode:
    """One radix-tree node. `kv_lock` counts holders at this node or below (a holder locks its whole
    path to the root); `state_lock` counts holders of this node's state (a pending copy-on-write)."""

    __slots__ = ("nid", "parent", "children", "key", "kv", "state", "kv_lock", "state_lock", "last_access", "end")

    def __init__(self, nid: int, parent: TreeNode | None, key: list[int], kv: list[int], end: int) -> None:
        self.nid = nid
        self.parent = parent
        self.children: dict[int, TreeNode] = {}
        self.key = key
        self.kv = kv
        self.state: int | None = None
        self.kv_lock = 0
        self.state_lock = 0
        self.last_access = 0
        self.end = end  # number of tokens from the root through this node's last token

    @property
    def start(self) -> int:
        return self.end - len(self.key)

    def __repr__(self) -> str:
        return (
            f"TreeNode(nid={self.nid}, span=[{self.start},{self.end}), state={self.state}, "
            f"kv_lock={self.kv_lock}, state_lock={self.state_lock})"
        )


class LruHeap:
    """Least-recently-used order with lazy invalidation.

    An entry is (last_access, nid, node) pushed whenever a node may have become a candidate. Popping
    skips entries whose node died, was touched since (last_access differs) or fails `is_candidate`, so
    stale entries cost nothing but memory. Rule: the heap never holds more than 4 entries per live
    node (+1024); `push` rebuilds it from the live candidates when it would, so memory stays bounded
    even when nothing is ever evicted (O(1) amortised: a rebuild follows at least 3 pushes per node).
    """

    def __init__(
        self,
        is_candidate: Callable[[TreeNode], bool],
        is_alive: Callable[[TreeNode], bool],
        live_nodes: Callable[[], Collection[TreeNode]],
    ) -> None:
        self._heap: list[tuple[int, int, TreeNode]] = []
        self._is_candidate = is_candidate
        self._is_alive = is_alive
        self._live_nodes = live_nodes

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, node: TreeNode) -> None:
        heapq.heappush(self._heap, (node.last_access, node.nid, node))
        if len(self._heap) > 4 * len(self._live_nodes()) + 1024:
            self.compact()

    def pop(self) -> TreeNode | None:
        """The least recently used live candidate, removed from the heap; None when there is none."""
        heap = self._heap
        while heap:
            access, _, node = heapq.heappop(heap)
            if access == node.last_access and self._is_alive(node) and self._is_candidate(node):
                return node
        return None

    def compact(self) -> None:
        """Keep one entry per live candidate (its current access time)."""
        self._heap = [(n.last_access, n.nid, n) for n in self._live_nodes() if self._is_candidate(n)]
        heapq.heapify(self._heap)


def common_prefix_len(tokens: list[int], offset: int, limit: int, key: list[int]) -> int:
    """Length of the common prefix of tokens[offset:limit] and key (block-wise slice compares)."""
    n = min(limit - offset, len(key))
    if tokens[offset : offset + n] == key[:n]:
        return n
    block = 64
    i = 0
    while i + block <= n and tokens[offset + i : offset + i + block] == key[i : i + block]:
        i += block
    while i < n and tokens[offset + i] == key[i]:
        i += 1
    return i
