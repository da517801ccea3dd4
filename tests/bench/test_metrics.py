"""Unit tests of benchmarks/serving_metrics.py: the pure workload and metric math of bench_serving."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.serving_metrics import (
    RequestResult,
    apply_chunk,
    build_requests,
    compute_metrics,
    find_vocab_size,
    format_report,
    itls_from_chunks,
    json_safe,
    median_metrics,
    percentile,
    poisson_gaps,
    prefix_hit_rate,
    sample_lengths,
    summarize_ms,
    ttft_from_chunks,
)

# no subnormals: a benchmark run earlier in the process flushes them (worker_proc.host.numerics)
floats = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_subnormal=False)


@settings(max_examples=200, deadline=None)
@given(st.lists(floats, min_size=1, max_size=50), st.floats(min_value=0, max_value=100, allow_subnormal=False))
def test_percentile_matches_numpy_linear(values: list[float], q: float) -> None:
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-9, abs=1e-6)


def test_percentile_edges() -> None:
    assert percentile([3.0, 1.0, 2.0], 0) == 1.0
    assert percentile([3.0, 1.0, 2.0], 100) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summarize_ms_converts_seconds() -> None:
    s = summarize_ms([0.001, 0.002, 0.003, 0.010])
    assert s["mean"] == pytest.approx(4.0)
    assert s["median"] == pytest.approx(2.5)
    assert s["p90"] == pytest.approx(float(np.percentile([1, 2, 3, 10], 90)))
    assert all(math.isnan(v) for v in summarize_ms([]).values())


def test_ttft_skips_chunks_without_tokens() -> None:
    assert ttft_from_chunks(10.0, [(10.5, 0), (10.75, 2), (11.0, 1)]) == pytest.approx(0.75)
    assert ttft_from_chunks(10.0, [(10.5, 0)]) is None
    assert ttft_from_chunks(10.0, []) is None


def test_itl_splits_multi_token_chunks_evenly() -> None:
    chunks = [(1.0, 1), (1.5, 0), (2.0, 2), (2.3, 1)]
    assert itls_from_chunks(chunks) == pytest.approx([0.5, 0.5, 0.3])
    assert itls_from_chunks([(1.0, 3)]) == []
    assert itls_from_chunks([]) == []


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(min_value=0, max_value=10, allow_subnormal=False), st.integers(0, 4)),
                min_size=1, max_size=30))
def test_itl_sum_spans_first_to_last_token_chunk(raw: list[tuple[float, int]]) -> None:
    chunks = sorted(raw)
    token_chunks = [(t, n) for t, n in chunks if n > 0]
    itls = itls_from_chunks(chunks)
    # one entry per token after the first chunk, and together they cover the whole decode span
    assert len(itls) == sum(n for _, n in token_chunks[1:])
    span = token_chunks[-1][0] - token_chunks[0][0] if token_chunks else 0.0
    assert sum(itls) == pytest.approx(span, abs=1e-9)


def test_prefix_hit_rate() -> None:
    assert prefix_hit_rate([0, 300, 300], [340, 340, 340]) == pytest.approx(600 / 1020)
    assert prefix_hit_rate([], []) == 0.0
    assert prefix_hit_rate([0], [0]) == 0.0


def test_sample_lengths_bounds_and_determinism() -> None:
    lens = sample_lengths(random.Random(1), 100, 0.5, 2000)
    assert min(lens) >= 50 and max(lens) <= 150
    assert min(lens) < 60 and max(lens) > 140  # actually spread over the range
    assert lens == sample_lengths(random.Random(1), 100, 0.5, 2000)
    assert sample_lengths(random.Random(2), 7, 0.0, 5) == [7] * 5
    assert min(sample_lengths(random.Random(3), 1, 0.9, 100)) >= 1
    with pytest.raises(ValueError):
        sample_lengths(random.Random(0), 10, 1.0, 1)


def test_poisson_gaps() -> None:
    assert poisson_gaps(random.Random(0), math.inf, 3) == [0.0, 0.0, 0.0]
    assert poisson_gaps(random.Random(0), 5.0, 0) == []
    gaps = poisson_gaps(random.Random(0), 20.0, 20001)
    assert gaps[0] == 0.0 and all(g > 0 for g in gaps[1:])
    assert sum(gaps[1:]) / 20000 == pytest.approx(1 / 20.0, rel=0.05)
    with pytest.raises(ValueError):
        poisson_gaps(random.Random(0), 0.0, 2)


def test_build_requests_shared_prefix_groups() -> None:
    kw = dict(num_prompts=7, input_len=5, output_len=3, range_ratio=0.0, shared_prefix_len=20,
              num_prefix_groups=3, vocab_size=50)  # fmt: skip
    specs = build_requests(random.Random(4), **kw)
    assert [s.prefix_group for s in specs] == [0, 1, 2, 0, 1, 2, 0]
    assert all(len(s.prompt_ids) == 25 and s.output_len == 3 for s in specs)
    assert all(0 <= t < 50 for s in specs for t in s.prompt_ids)
    prefixes = {g: {tuple(s.prompt_ids[:20]) for s in specs if s.prefix_group == g} for g in range(3)}
    assert all(len(p) == 1 for p in prefixes.values())  # one prefix per group
    assert len({next(iter(p)) for p in prefixes.values()}) == 3  # groups differ
    assert len({tuple(s.prompt_ids[20:]) for s in specs}) == 7  # suffixes differ
    assert build_requests(random.Random(4), **kw) == specs
    plain = build_requests(random.Random(4), **{**kw, "shared_prefix_len": 0})
    assert all(s.prefix_group is None and len(s.prompt_ids) == 5 for s in plain)


def test_find_vocab_size() -> None:
    assert find_vocab_size({"args": {"port": 1}, "model_info": {"vocab_size": 260}}) == 260
    assert find_vocab_size([{"x": 1}, {"vocab_size": 7}]) == 7
    assert find_vocab_size({"vocab_size": True, "m": {"vocab_size": 0}}) is None
    assert find_vocab_size("vocab_size") is None


def test_apply_chunk_generate_counts_cumulative_tokens() -> None:
    res = RequestResult(prompt_tokens=10)
    apply_chunk("generate", {"meta_info": {"prompt_tokens": 12, "completion_tokens": 1, "cached_tokens": 8}}, res, 1.0)
    apply_chunk("generate", {"meta_info": {"completion_tokens": 3}}, res, 2.0)
    apply_chunk("generate", {"meta_info": {"completion_tokens": 3, "finish_reason": {"type": "length"}}}, res, 3.0)
    assert res.chunks == [(1.0, 1), (2.0, 2), (3.0, 0)]
    assert (res.prompt_tokens, res.completion_tokens, res.cached_tokens) == (12, 3, 8)
    with pytest.raises(RuntimeError, match="boom"):
        apply_chunk("generate", {"error": {"message": "boom"}}, res, 4.0)
    with pytest.raises(RuntimeError):
        apply_chunk("generate", ["not", "an", "object"], res, 4.0)


def test_apply_chunk_openai_usage_overrides_count() -> None:
    res = RequestResult(prompt_tokens=10)
    apply_chunk("openai", {"choices": [{"text": "a", "finish_reason": None}]}, res, 1.0)
    apply_chunk("openai", {"choices": [{"text": "", "finish_reason": None}]}, res, 2.0)  # held-back bytes
    apply_chunk("openai", {"choices": [{"text": "", "finish_reason": "length"}]}, res, 3.0)
    assert res.chunks == [(1.0, 1), (2.0, 1)] and res.completion_tokens == 2
    usage = {"prompt_tokens": 11, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 5}}
    apply_chunk("openai", {"choices": [], "usage": usage}, res, 4.0)
    assert (res.prompt_tokens, res.completion_tokens, res.cached_tokens) == (11, 4, 5)


def _result(start: float, chunks: list[tuple[float, int]], prompt: int, cached: int) -> RequestResult:
    out = sum(n for _, n in chunks)
    return RequestResult(True, "", start, chunks[-1][0], chunks, prompt, out, cached)


def test_compute_metrics_and_report() -> None:
    results = [
        _result(0.0, [(0.1, 1), (0.3, 1), (0.5, 2)], prompt=100, cached=0),
        _result(1.0, [(1.2, 2), (1.6, 1)], prompt=100, cached=80),
        RequestResult(False, "HTTP 503: busy", 0.0, 0.1),
    ]
    m = compute_metrics(results, duration_s=2.0)
    assert (m["completed"], m["failed"], m["errors"]) == (2, 1, ["HTTP 503: busy"])
    assert (m["total_input_tokens"], m["total_output_tokens"], m["total_cached_tokens"]) == (200, 7, 80)
    assert m["prefill_tokens_computed"] == 120 and m["prefix_cache_hit_rate"] == pytest.approx(0.4)
    assert m["request_throughput"] == 1.0 and m["output_token_throughput"] == 3.5
    assert m["ttft_ms"]["mean"] == pytest.approx(150.0)  # (100 + 200) / 2
    assert m["itl_ms"]["median"] == pytest.approx(150.0)  # ITLs 200, 100, 100, 400 ms
    assert m["itl_ms"]["mean"] == pytest.approx(200.0)
    assert m["e2e_ms"]["p99"] == pytest.approx(float(np.percentile([500, 600], 99)))
    table = format_report(m)
    assert "Prefix cache hit rate:" in table and "40.00%" in table and "Median ITL (ms):" in table


def test_median_metrics_and_json_safe() -> None:
    runs = [
        {"completed": 1, "rate": 1.0, "ttft_ms": {"mean": 10.0}, "errors": ["a"], "name": "x"},
        {"completed": 3, "rate": math.nan, "ttft_ms": {"mean": 30.0}, "errors": ["b"], "name": "y"},
        {"completed": 2, "rate": 3.0, "ttft_ms": {"mean": 20.0}, "errors": [], "name": "z"},
    ]
    med = median_metrics(runs)
    assert med == {"completed": 2, "rate": 2.0, "ttft_ms": {"mean": 20.0}, "errors": ["a", "b"], "name": "x"}
    safe = json_safe({"a": [math.nan, 1.5, math.inf], "b": (2, "s")})
    assert safe == {"a": [None, 1.5, None], "b": [2, "s"]}
    json.dumps(safe, allow_nan=False)


def test_apply_chunk_llama_server_counts_cumulative_tokens() -> None:
    res = RequestResult(prompt_tokens=0)
    apply_chunk("llama-server", {"content": "", "stop": False, "tokens_predicted": 0, "tokens_evaluated": 9}, res, 1.0)
    apply_chunk("llama-server", {"content": "a", "stop": False, "tokens_predicted": 1, "tokens_evaluated": 9}, res, 2.0)
    apply_chunk("llama-server", {"content": "bc", "stop": False, "tokens_predicted": 3}, res, 3.0)
    final = {"content": "", "stop": True, "tokens_predicted": 3, "tokens_evaluated": 9, "timings": {"cache_n": 4}}
    apply_chunk("llama-server", final, res, 4.0)
    assert res.chunks == [(1.0, 0), (2.0, 1), (3.0, 2), (4.0, 0)]
    assert (res.prompt_tokens, res.completion_tokens, res.cached_tokens) == (9, 3, 4)
    assert ttft_from_chunks(0.5, res.chunks) == 1.5  # the progress chunk carries no token
    with pytest.raises(RuntimeError, match="not a llama-server"):
        apply_chunk("llama-server", {"choices": []}, res, 5.0)
    with pytest.raises(RuntimeError, match="server error"):
        apply_chunk("llama-server", {"error": {"code": 500}}, res, 5.0)
