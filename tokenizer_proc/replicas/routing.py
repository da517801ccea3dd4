"""Which `--dp-size` replica a request goes to: cache-aware first, least-loaded otherwise.

Policy (`CacheAwareRouter.choose`), over the replicas that are up:

1. Prefix match. Each replica has an approximate index of the prompts sent to it (`PrefixIndex`);
   a request's match on a replica is the length of its longest prefix found there, in whole blocks
   of `block_tokens`. The best match counts when it is at least `min_match_tokens` long and at least
   `min_match_ratio` of the prompt; the request then goes to the replica with that match (of several
   with it, the least loaded) -- unless that replica is overloaded: more than `balance_abs` requests
   in flight beyond the least-loaded replica and more than `balance_rel` times its count.
2. Otherwise the least-loaded replica (fewest requests in flight from this tokenizer; ties go to the
   one that was sent the fewest requests so far, so a sequential load alternates).
3. The chosen replica's index takes the prompt (its scheduler caches what it computes).

Why: on a hybrid model a prefix hit skips the whole shared prefix (the cached Mamba state resumes
there; a miss recomputes every token of it), so sending a request where its prefix is cached is worth
more than perfect balance. A short match saves little, so balance decides then; and a replica whose
queue is far longer than another's costs more in waiting than one recomputation of the prefix on the
other replica, which from then on holds the prefix too (ties among equal matches then spread the
load). This is SGLang's cache-aware router policy (sglang-router `cache_aware`: prefix-match
threshold, absolute and relative balance thresholds) applied inside one server, with the load test
made against the chosen replica. SGLang's in-process DP controller balances by round robin, shortest
queue or fewest tokens, none of which looks at the prompt, so it loses the prefix hits that matter
most here.

The index is approximate by design: it records what was sent, not what the scheduler still caches
(it may have evicted it, or not yet computed it), and it is bounded (`max_blocks` per replica, least
recently used first out). A wrong guess costs a cache miss, never a wrong answer. A replica that goes
down or flushes its cache is forgotten (`forget`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

logger = logging.getLogger(__name__)

Reason = Literal["cache", "load", "balance"]


@dataclass(frozen=True)
class RoutingConfig:
    """Thresholds of the policy (module docstring)."""

    block_tokens: int = 16
    min_match_tokens: int = 16
    min_match_ratio: float = 0.3
    balance_abs: int = 8
    balance_rel: float = 1.5
    max_blocks: int = 1 << 16  # per replica: 1M prompt tokens at 16 per block

    def __post_init__(self) -> None:
        if self.block_tokens < 1 or self.max_blocks < 1 or self.balance_abs < 0 or self.balance_rel < 1.0:
            raise ValueError(f"invalid routing config: {self}")


def block_hashes(tokens: Sequence[int], block: int) -> list[int]:
    """One hash per whole block of `tokens`, each covering every token up to its block's end: the
    path of a token trie with `block`-token edges, so equal hashes mean equal prefixes (up to
    hash collisions, which cost a mis-routed request at most)."""
    out: list[int] = []
    h = 0
    for end in range(block, len(tokens) + 1, block):
        h = hash((h, tuple(tokens[end - block:end])))
        out.append(h)
    return out


class PrefixIndex:
    """The prompt prefixes sent to one replica, as block-chain hashes in least-recently-used order."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` are held (stops at the first one that is not)."""
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[int]) -> None:
        """Hold (and touch) every block; the least recently used go beyond `max_blocks`. Deepest
        first, so the prefix blocks of a prompt are the most recent and are evicted last."""
        for h in reversed(hashes):
            self._lru[h] = None
            self._lru.move_to_end(h)
        while len(self._lru) > self.max_blocks:
            self._lru.popitem(last=False)

    def clear(self) -> None:
        self._lru.clear()

    def __len__(self) -> int:
        return len(self._lru)


@dataclass(frozen=True)
class Decision:
    replica: int
    reason: Reason
    matched_tokens: int  # the chosen replica's indexed prefix of the prompt, before this request


class CacheAwareRouter:
    """The routing policy over `n` replicas (module docstring). Pure: the caller passes the live
    replicas and their loads; the router keeps only the prefix indexes and per-replica send counts."""

    def __init__(self, n: int, config: RoutingConfig | None = None) -> None:
        self.config = config or RoutingConfig()
        self.indexes = [PrefixIndex(self.config.max_blocks) for _ in range(n)]
        self.sent = [0] * n

    def choose(self, tokens: Sequence[int], live: Sequence[int], loads: Sequence[int]) -> Decision:
        """The replica for a prompt of `tokens`; `live`: replicas up (not empty); `loads[d]`: requests
        in flight on replica d. Records the prompt in the chosen replica's index."""
        if not live:
            raise ValueError("no replica is up")
        cfg = self.config
        hashes = block_hashes(tokens, cfg.block_tokens)
        matched = {d: self.indexes[d].match(hashes) * cfg.block_tokens for d in live}
        least = min(live, key=lambda d: (loads[d], self.sent[d], d))
        best_len = max(matched.values())
        reason: Reason = "load"
        chosen = least
        if best_len >= cfg.min_match_tokens and best_len >= cfg.min_match_ratio * len(tokens):
            best = min((d for d in live if matched[d] == best_len), key=lambda d: (loads[d], self.sent[d], d))
            if self._overloaded(loads[best], loads[least]):
                reason = "balance"
            else:
                reason, chosen = "cache", best
        self.indexes[chosen].insert(hashes)
        self.sent[chosen] += 1
        return Decision(chosen, reason, matched[chosen])

    def _overloaded(self, load: int, least_load: int) -> bool:
        cfg = self.config
        return load - least_load > cfg.balance_abs and load > cfg.balance_rel * least_load

    def forget(self, replica: int) -> None:
        """The replica's cache is gone (it went down or was flushed): nothing matches there any more."""
        self.indexes[replica].clear()

    def check_integrity(self) -> None:
        assert len(self.indexes) == len(self.sent)
        assert all(len(ix) <= ix.max_blocks for ix in self.indexes)
        assert all(n >= 0 for n in self.sent)
