"""bench_peers' prompts: the same token ids for every system, drawn from a seed (pure).

Per run k (random.Random(seed + k); ids avoid the config's bos/eos/pad):
- ``warmup``: the unmeasured first request of a server (allocators, lazy init): --input-len copies
  of one id reserved for it (`warmup_id`, the same in every run), which no other prompt contains, so
  no measured prompt shares a token with it;
- ``throughput``: {c: c distinct --input-len prompts} per concurrency level;
- ``cold``: a fresh --input-len prompt: no token of the warm-up, and a first id that no throughput
  prompt of its run starts with (nothing before it in the run is a prefix of it);
- ``prefix_only`` [P], ``prefix`` [P + suffix]: the continuation of a cached prompt;
- ``shared_warm`` [P2+sA, P2+sB], ``shared`` [P2+sC]: a fresh prefix P2 whose first id no other prompt
  of the run starts with, and three suffixes with three different first ids (so P2+sC shares exactly
  P2 with the two before it).
The draws come in the order of earlier versions of this tool (throughput, P, cold, P's suffix, P2,
suffixes); a draw is redone only where a rule above rejects it, so with a large vocabulary the
prompts are nearly always those of earlier versions.
"""

from __future__ import annotations

import json
import os
import random

from benchmarks.peers_commands import PeersConfig

RunPrompts = dict[str, object]


def model_ids(model: str) -> tuple[int, set[int]]:
    """The checkpoint's vocabulary size and its bos/eos/pad ids (no prompt contains them)."""
    with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
        c = json.load(f)
    banned = {c.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return int(c["vocab_size"]), {int(t) for t in banned if isinstance(t, int)}


def warmup_id(vocab: int, banned: set[int], seed: int) -> int:
    """The id the warm-up prompt is made of (reserved: no other prompt uses it)."""
    allowed = [t for t in range(vocab) if t not in banned]
    if len(allowed) < 2:
        raise ValueError(f"a vocabulary of {vocab} ids ({len(banned)} banned) is too small for the prompts")
    return random.Random(f"bench_peers warm-up {seed}").choice(allowed)


def make_prompts(cfg: PeersConfig, vocab: int, banned: set[int]) -> list[RunPrompts]:
    """Every run's prompts (see the module docstring); ValueError when the vocabulary is too small."""
    warm = warmup_id(vocab, banned, cfg.seed)
    excluded = banned | {warm}
    allowed = vocab - len({t for t in excluded if 0 <= t < vocab})
    out = []
    for k in range(cfg.runs):
        rng = random.Random(cfg.seed + k)

        def draw(n: int, avoid_first: frozenset[int] = frozenset(), rng: random.Random = rng) -> list[int]:
            if len({t for t in avoid_first if t not in excluded}) >= allowed:
                raise ValueError(f"a vocabulary of {vocab} ids ({len(banned)} banned) is too small for the prompts")
            ids: list[int] = []
            while len(ids) < n:
                t = rng.randrange(vocab)
                if t not in excluded and (ids or t not in avoid_first):
                    ids.append(t)
            return ids

        thr = {c: [draw(cfg.input_len) for _ in range(c)] for c in cfg.levels}
        thr_firsts = frozenset(p[0] for c in cfg.levels for p in thr[c])
        prefix = draw(cfg.prefix_len)
        cold = draw(cfg.input_len, thr_firsts)
        run: RunPrompts = {"warmup": [[warm] * cfg.input_len], "throughput": thr, "cold": [cold],
                           "prefix_only": [prefix]}  # fmt: skip
        run["prefix"] = [prefix + draw(cfg.suffix_len)]
        shared = draw(cfg.prefix_len, thr_firsts | {cold[0], prefix[0]})
        suffixes: list[list[int]] = []
        for _ in range(3):
            suffixes.append(draw(cfg.suffix_len, frozenset(sfx[0] for sfx in suffixes)))
        run["shared_warm"] = [shared + suffixes[0], shared + suffixes[1]]
        run["shared"] = [shared + suffixes[2]]
        out.append(run)
    return out
