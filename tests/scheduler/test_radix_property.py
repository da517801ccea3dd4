"""Property test of HybridRadixCache alone (hypothesis): random inserts (donations, kept progress),
copy-on-write matches, copy completions, releases, evictions, flushes and unkeeps keep the tree's
invariants and the slot accounting, and the epoch rule holds: while `epoch` is unchanged, a peek
returns exactly what it returned before (the scheduler's O(1) retry reuses it on that promise)."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, rule

from scheduler_proc.allocators import KVAllocator, StateSlotAllocator
from scheduler_proc.radix_cache import CowMatch, HybridRadixCache, PeekResult
from shared.errors import StateCowAllocError

TOKENS = st.lists(st.integers(1, 2), min_size=1, max_size=8)


def peek_key(p: PeekResult) -> tuple[int, int, int, int, int, bool]:
    return (p.node.nid, p.prefix_len, p.kv_len, p.lock_cost_kv, p.state_lock_cost, p.has_state)


class CacheMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")  # token sequences used before: matches and unkeeps revisit them

    @initialize(kv=st.integers(8, 40), states=st.integers(1, 5), track=st.booleans())
    def setup(self, kv: int, states: int, track: bool) -> None:
        self.cache = HybridRadixCache(KVAllocator(kv), StateSlotAllocator(states if track else 0), track)
        self.held: list[tuple[CowMatch, bool]] = []  # (match, copy still pending)
        self.probes: dict[tuple[int, ...], tuple[int, tuple[int, int, int, int, int, bool]]] = {}

    @rule(target=seqs, tokens=TOKENS, with_state=st.booleans(), keep=st.booleans())
    def donate(self, tokens: list[int], with_state: bool, keep: bool) -> list[int]:
        c = self.cache
        kv = c.alloc_kv(len(tokens))
        if kv is None:
            return tokens
        state = c.alloc_state() if with_state and c.track_states else None
        node = c.insert(tokens, len(tokens), kv, 0, state, keep)
        assert c.path_kv(node) == [s for n in self._path(node) for s in n.kv] and node.end == len(tokens)
        self.probes.setdefault(tuple(tokens) + (0,), (-1, (0, 0, 0, 0, 0, False)))
        return tokens

    @rule(tokens=st.one_of(seqs, TOKENS))
    def match(self, tokens: list[int]) -> None:
        c = self.cache
        before = (c.num_locked_nodes, c.kv_evictable, c.states_evictable, c.state_alloc.num_free)
        probe = tokens + [0]
        self.probes.setdefault(tuple(probe), (-1, (0, 0, 0, 0, 0, False)))
        try:
            m = c.match_and_cow(probe, len(tokens))
        except StateCowAllocError:
            after = (c.num_locked_nodes, c.kv_evictable, c.states_evictable, c.state_alloc.num_free)
            assert after[:1] == before[:1] and c.direct_kv_holds(c.peek(probe, len(tokens)).node) >= 0
            return
        assert m.prefix_kv == c.path_kv(m.node) and m.prefix_len == m.node.end <= len(tokens)
        assert (m.src_state is not None) == (m.dst_state is not None) == (m.node.state is not None and c.track_states)
        self.held.append((m, m.src_state is not None))

    @rule(i=st.integers(0, 20))
    def copy_done(self, i: int) -> None:
        pending = [k for k, (_, p) in enumerate(self.held) if p]
        if pending:
            k = pending[i % len(pending)]
            m, _ = self.held[k]
            self.cache.unlock_state(m.node)
            self.held[k] = (m, False)

    @rule(i=st.integers(0, 20), donate=st.booleans())
    def release(self, i: int, donate: bool) -> None:
        """A holder ends: its private state either goes back to the pool or is donated at its node."""
        if not self.held:
            return
        m, pending = self.held.pop(i % len(self.held))
        c = self.cache
        if pending:
            c.unlock_state(m.node)
        if m.dst_state is not None:
            if donate and not pending and m.node.end > 0:
                path = self._tokens(m.node)
                c.insert(path, len(path), m.prefix_kv, len(path), m.dst_state)
            else:
                c.state_alloc.free(m.dst_state)
        c.unlock(m.node)

    @rule(n=st.integers(1, 12))
    def evict_kv(self, n: int) -> None:
        self.cache.evict_kv(n)

    @rule(n=st.integers(1, 3))
    def evict_states(self, n: int) -> None:
        self.cache.evict_states(n)

    @rule()
    def flush(self) -> None:
        self.cache.flush()
        assert all(n.kv_lock > 0 for n in self.cache.nodes()) or not self.cache.nodes()

    @rule(tokens=st.one_of(seqs, TOKENS))
    def unkeep(self, tokens: list[int]) -> None:
        self.cache.unkeep(tokens + [0], len(tokens))

    def _path(self, node: object) -> list:
        out = []
        while node is not self.cache.root:
            out.append(node)
            node = node.parent  # type: ignore[attr-defined]
        return out[::-1]

    def _tokens(self, node: object) -> list[int]:
        return [t for n in self._path(node) for t in n.key]

    @invariant()
    def integrity(self) -> None:
        c = self.cache
        c.check_integrity()
        c.kv_alloc.check_integrity()
        c.state_alloc.check_integrity()
        assert c.kv_alloc.num_free + c.kv_total == c.kv_alloc.capacity
        own_states = sum(1 for m, _ in self.held if m.dst_state is not None)
        assert c.state_alloc.num_free + c.states_total + own_states == c.state_alloc.capacity
        holds: dict[int, int] = {}
        for m, pending in self.held:
            holds[m.node.nid] = holds.get(m.node.nid, 0) + 1
            assert not pending or m.node.state_lock > 0
        for node in c.nodes():
            assert c.direct_kv_holds(node) == holds.get(node.nid, 0), node
        assert sum(1 for _, p in self.held if p) == sum(n.state_lock for n in c.nodes())

    @invariant()
    def epoch_rule(self) -> None:
        """A peek taken at the current epoch equals the one taken when the epoch was last seen."""
        c = self.cache
        for probe, (epoch, key) in list(self.probes.items()):
            now = peek_key(c.peek(list(probe), len(probe) - 1))
            if epoch == c.epoch:
                assert now == key, (probe, key, now)
            self.probes[probe] = (c.epoch, now)


CacheMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestRadixCacheProperties = CacheMachine.TestCase
