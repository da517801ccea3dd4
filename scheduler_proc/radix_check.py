"""Structural integrity check of a HybridRadixCache (used by tests and `Scheduler.check_integrity`)."""

from __future__ import annotations

from collections.abc import Mapping

from scheduler_proc.radix_node import TreeNode


def check_tree(root: TreeNode, registry: Mapping[int, TreeNode], track_states: bool,
               counters: Mapping[str, int]) -> None:
    """Raise AssertionError naming the first broken rule: shape, lock counts, counters, slot uniqueness.
    `registry`: the tree's nodes by id; `counters`: the tree's kept counts (kv_total, kv_evictable,
    states_total, states_evictable, num_locked_nodes), each checked against a recount."""
    assert root.parent is None and not root.key and root.state is None, "bad root"
    seen: dict[int, object] = {}
    kv_total = kv_evictable = states = states_evictable = locked = 0
    kv_seen: set[int] = set()
    state_seen: set[int] = set()
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        parent = node.parent
        assert parent is not None, f"{node} has no parent"
        assert node.key and len(node.key) == len(node.kv), f"{node}: key/kv lengths differ or empty"
        assert parent.children.get(node.key[0]) is node, f"{node} not indexed under its first token"
        assert node.end == parent.end + len(node.key), f"{node}: end inconsistent with its parent"
        assert node.nid not in seen, f"{node} reachable twice"
        assert registry.get(node.nid) is node, f"{node} missing from the node registry"
        seen[node.nid] = node
        child_locks = sum(c.kv_lock for c in node.children.values())
        assert node.kv_lock >= child_locks, f"{node}: kv_lock below its children's sum {child_locks}"
        assert node.state_lock >= 0, f"{node}: negative state lock"
        assert node.state_lock == 0 or node.state is not None, f"{node}: state lock on a tombstone"
        assert node.state_lock == 0 or node.kv_lock > 0, f"{node}: state locked but KV unlocked"
        for slot in node.kv:
            assert slot not in kv_seen, f"kv slot {slot} held twice by the tree"
            kv_seen.add(slot)
        kv_total += len(node.kv)
        if node.kv_lock == 0:
            kv_evictable += len(node.kv)
        else:
            locked += 1
        if node.state is not None:
            assert track_states, f"{node} has a state in an attention-only cache"
            assert node.state not in state_seen, f"state slot {node.state} held twice by the tree"
            state_seen.add(node.state)
            states += 1
            if node.state_lock == 0:
                states_evictable += 1
        stack.extend(node.children.values())
    assert len(seen) == len(registry), f"{len(registry) - len(seen)} registered nodes unreachable"
    recount = {"kv_total": kv_total, "kv_evictable": kv_evictable, "states_total": states,
               "states_evictable": states_evictable, "num_locked_nodes": locked}  # fmt: skip
    for name, actual in recount.items():
        assert counters[name] == actual, f"radix cache counter {name} = {counters[name]}, recount {actual}"
