"""bench_peers' prompts (shared by every system, distinct, avoiding special ids, the shared-prefix
scenario) and the HTTP measurement against the fake server."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.bench_peers import PeersConfig, make_prompts, measure_http
from benchmarks.peers_procs import PeerError
from tests.bench.fake_server import VOCAB_SIZE, FakeServer

pytestmark = pytest.mark.timeout(120)


def test_prompts_are_shared_distinct_and_avoid_special_ids() -> None:
    cfg = PeersConfig(model="m", runs=2, levels=(1, 3), input_len=10, prefix_len=20, suffix_len=5)
    a, b = make_prompts(cfg, 50, {0, 1, 2}), make_prompts(cfg, 50, {0, 1, 2})
    assert a == b and a[0] != a[1]  # same for every system; runs differ
    run = a[0]
    flat = [p for c in (1, 3) for p in run["throughput"][c]] + run["cold"]  # type: ignore[index, operator]
    assert len({tuple(p) for p in flat}) == 5 and all(len(p) == 10 for p in flat)
    assert run["prefix"][0][:20] == run["prefix_only"][0] and len(run["prefix"][0]) == 25  # type: ignore[index]
    every = flat + run["prefix"] + run["shared_warm"] + run["shared"]  # type: ignore[operator]
    assert not {0, 1, 2} & {t for p in every for t in p}
    # the warm-up: one reserved id, the same in every run, in no other prompt (so the cold one shares none)
    (warm,) = run["warmup"]  # type: ignore[misc]
    assert len(warm) == 10 and len(set(warm)) == 1 and a[1]["warmup"] == run["warmup"] and warm[0] not in {0, 1, 2}
    assert all(warm[0] not in p for r in a for p in r["cold"] + r["prefix"] + r["shared_warm"] + r["shared"])  # type: ignore[operator]
    assert all(r["cold"][0][0] not in {p[0] for c in (1, 3) for p in r["throughput"][c]} for r in a)  # type: ignore[index]


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_shared_prefix_prompts() -> None:
    # a small vocabulary, so distinct first ids are a property of make_prompts, not of chance
    cfg = PeersConfig(model="m", runs=3, levels=(1, 8), input_len=10, prefix_len=20, suffix_len=5)
    for run in make_prompts(cfg, 16, {0, 1}):
        (pa, pb), (pc,) = run["shared_warm"], run["shared"]  # type: ignore[misc]
        p2 = pc[:20]
        assert len(pa) == len(pb) == len(pc) == 25 and pa[:20] == pb[:20] == p2
        assert len({pa[20], pb[20], pc[20]}) == 3  # three distinct suffixes, so exactly P2 is shared
        assert _common(pc, pa) == _common(pc, pb) == _common(pa, pb) == 20
        others = [p for c in (1, 8) for p in run["throughput"][c]] + run["cold"] + run["prefix"]  # type: ignore[index, operator]
        assert all(_common(p2, p) == 0 for p in others)  # P2 is fresh: no prefix in common with any other prompt
        assert p2 != run["prefix_only"][0]  # type: ignore[index]
    with pytest.raises(ValueError, match="too small"):  # one allowed id: P2 cannot start differently
        make_prompts(cfg, 3, {0, 1})


@pytest.mark.parametrize("backend", ["hyssm", "llama-server"])
def test_measure_http_against_the_fake(server: FakeServer, backend: str) -> None:
    server.reset()
    cfg = PeersConfig(model="m", runs=1, levels=(1, 4), input_len=6, output_len=5, prefix_len=12, suffix_len=3,
                      settle_quiet_s=0.05)  # fmt: skip
    run = make_prompts(cfg, VOCAB_SIZE, set())[0]
    m = asyncio.run(measure_http(server.base_url, backend, run, cfg, warmup=True))
    seen = server.state.seen
    assert len(seen) == 1 + 1 + 4 + 1 + 2 + 3  # warm-up, c=1, c=4, cold, prefix, prefix hit, shared x3
    assert [s.max_tokens for s in seen] == [2, 5, 5, 5, 5, 5, 1, 1, 1, 1, 1, 1]
    assert seen[0].prompt_ids == run["warmup"][0] and not set(seen[0].prompt_ids) & set(seen[6].prompt_ids)  # type: ignore[index]
    assert seen[6].prompt_ids == run["cold"][0] and seen[6].cached_tokens == 0  # type: ignore[index]
    assert seen[8].prompt_ids[:12] == seen[7].prompt_ids and seen[8].cached_tokens == 12
    # the shared-prefix scenario last, in order: P2+sA, P2+sB (teaching), then the measured P2+sC
    assert [s.prompt_ids for s in seen[9:]] == [*run["shared_warm"], *run["shared"]]  # type: ignore[misc]
    assert [s.cached_tokens for s in seen[9:]] == [0, 12, 12]  # fresh P2, then exactly P2 shared
    assert set(m) == {"tps_c1", "tps_c4", "decode_ms", "ttft_cold_ms", "ttft_prefix_ms", "ttft_shared_ms",
                      "settle_cold_s", "settle_prefix_s", "settle_shared_s"}  # fmt: skip
    assert all(v > 0 for v in m.values())
    assert all(m[f"settle_{k}_s"] >= 0.05 for k in ("cold", "prefix", "shared"))  # a quiet window each
    assert m["tps_c4"] > m["tps_c1"]  # four streams in parallel against the fake's fixed pace


def test_measure_http_raises_on_failed_requests(server: FakeServer) -> None:
    server.reset(fail_every=2)
    cfg = PeersConfig(model="m", runs=1, levels=(1, 2), input_len=4, output_len=2, prefix_len=4, suffix_len=2)
    with pytest.raises(PeerError, match="1 of 2 requests failed, first: RuntimeError: HTTP 503"):
        asyncio.run(measure_http(server.base_url, "hyssm", make_prompts(cfg, VOCAB_SIZE, set())[0], cfg, False))
