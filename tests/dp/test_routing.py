"""The --dp-size routing policy (tokenizer_proc/replicas/routing.py), decision by decision."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenizer_proc.replicas.routing import CacheAwareRouter, PrefixIndex, RoutingConfig, block_hashes

PREFIX = list(range(100, 164))  # 64 tokens: four blocks of 16


def prompt(suffix_seed: int, prefix: list[int] = PREFIX, suffix_len: int = 16) -> list[int]:
    rng = random.Random(suffix_seed)
    return prefix + [rng.randrange(1000, 2000) for _ in range(suffix_len)]


def test_block_hashes_are_prefix_paths() -> None:
    a, b = block_hashes(prompt(1), 16), block_hashes(prompt(2), 16)
    assert len(a) == 5 and a[:4] == b[:4] and a[4] != b[4]
    assert block_hashes(list(range(15)), 16) == []  # no whole block
    # the same block after a different prefix is a different path
    assert block_hashes([1] * 16 + [7] * 16, 16)[1] != block_hashes([2] * 16 + [7] * 16, 16)[1]


def test_index_matches_leading_blocks_and_evicts_least_recent() -> None:
    ix = PrefixIndex(max_blocks=6)
    first = block_hashes(prompt(1), 16)
    ix.insert(first)
    assert ix.match(first) == 5 and ix.match(block_hashes(prompt(2), 16)) == 4
    other = block_hashes(list(range(3000, 3048)), 16)  # 3 blocks: 8 held, 2 of the first prompt go
    ix.insert(other)
    assert len(ix) == 6 and ix.match(other) == 3
    # the deepest blocks of the first prompt were its least recently used: its head still matches
    assert ix.match(first) == 3
    ix.clear()
    assert ix.match(first) == 0


def test_longest_prefix_wins_and_the_prompt_is_recorded() -> None:
    router = CacheAwareRouter(3)
    first = router.choose(prompt(1), live=[0, 1, 2], loads=[0, 0, 0])
    assert first.reason == "load" and first.matched_tokens == 0
    second = router.choose(prompt(2), live=[0, 1, 2], loads=[1, 0, 0])  # the holder is busier, within bounds
    assert (second.replica, second.reason, second.matched_tokens) == (first.replica, "cache", 64)
    # an exact repeat matches all five blocks there
    assert router.choose(prompt(1), live=[0, 1, 2], loads=[0, 0, 0]).matched_tokens == 80


def test_short_match_falls_back_to_least_loaded() -> None:
    router = CacheAwareRouter(2, RoutingConfig(min_match_tokens=16, min_match_ratio=0.3))
    router.choose(PREFIX[:16] + [5] * 100, live=[0, 1], loads=[0, 0])  # replica 0 holds one block
    # 16 of 116 tokens match on replica 0: below 30 %, so load decides
    d = router.choose(PREFIX[:16] + [6] * 100, live=[0, 1], loads=[1, 0])
    assert (d.replica, d.reason) == (1, "load")
    # a match long enough in tokens and share goes to its replica even when it is busier
    d = router.choose(PREFIX[:16] + [5] * 30, live=[0, 1], loads=[3, 0])
    assert (d.replica, d.reason) == (0, "cache")


def test_overloaded_holder_spills_then_both_hold_the_prefix() -> None:
    router = CacheAwareRouter(2, RoutingConfig(balance_abs=4, balance_rel=1.5))
    assert router.choose(prompt(0), [0, 1], [0, 0]).replica == 0
    # within the bound (4 more than the least loaded): affinity holds
    assert router.choose(prompt(1), [0, 1], [4, 0]).reason == "cache"
    # beyond it: the least-loaded replica takes the request, and its prefix from then on
    spill = router.choose(prompt(2), [0, 1], [5, 0])
    assert (spill.replica, spill.reason) == (1, "balance")
    # equal matches on both: the less loaded one
    assert router.choose(prompt(3), [0, 1], [2, 1]).replica == 1
    assert router.choose(prompt(4), [0, 1], [1, 2]).replica == 0
    # the relative bound too: 9 in flight against 8 is more than balance_abs 0 beyond it but not 1.5 times it
    router2 = CacheAwareRouter(2, RoutingConfig(balance_abs=0, balance_rel=1.5))
    router2.choose(prompt(0), [0, 1], [0, 0])
    assert router2.choose(prompt(1), [0, 1], [9, 8]).reason == "cache"
    assert router2.choose(prompt(2), [0, 1], [13, 8]).reason == "balance"


def test_only_live_replicas_are_chosen_and_forget_drops_the_index() -> None:
    router = CacheAwareRouter(2)
    assert router.choose(prompt(0), [0, 1], [0, 0]).replica == 0
    d = router.choose(prompt(1), live=[1], loads=[0, 0])
    assert (d.replica, d.reason) == (1, "load")
    router.forget(1)
    router.forget(0)
    assert router.choose(prompt(2), [0, 1], [0, 0]).reason == "load"
    with pytest.raises(ValueError, match="no replica"):
        router.choose(prompt(3), live=[], loads=[0, 0])


def test_sequential_distinct_prompts_alternate() -> None:
    router = CacheAwareRouter(2)
    chosen = [router.choose([i] * 40, [0, 1], [0, 0]).replica for i in range(6)]
    assert chosen == [0, 1, 0, 1, 0, 1]


def test_invalid_config_is_refused() -> None:
    with pytest.raises(ValueError, match="routing config"):
        RoutingConfig(block_tokens=0)
    with pytest.raises(ValueError, match="routing config"):
        RoutingConfig(balance_rel=0.5)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), st.lists(st.integers(0, 6), min_size=3, max_size=3),
                          st.sets(st.integers(0, 2), min_size=1)), max_size=40))  # fmt: skip
def test_any_sequence_picks_a_live_replica_and_respects_the_bound(ops: list) -> None:
    """Whatever the prompts and loads, the choice is a live replica; a cache choice is one of the
    longest matches and never one more than balance_abs beyond the least loaded (and balance_rel times it)."""
    cfg = RoutingConfig(block_tokens=4, min_match_tokens=4, max_blocks=12, balance_abs=2)
    router = CacheAwareRouter(3, cfg)
    for group, extra, loads, live in ops:
        tokens = [group] * 12 + [extra] * 6
        hashes = block_hashes(tokens, 4)
        matches = {d: router.indexes[d].match(hashes) * 4 for d in live}
        d = router.choose(tokens, sorted(live), loads)
        assert d.replica in live and d.matched_tokens == matches[d.replica]
        least = min(loads[i] for i in live)
        if d.reason == "cache":
            assert d.matched_tokens == max(matches.values())
            assert not (loads[d.replica] - least > 2 and loads[d.replica] > 1.5 * least)
        else:
            assert loads[d.replica] == least
        router.check_integrity()
