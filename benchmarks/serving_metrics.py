"""Pure workload and metric functions of bench_serving.py (no I/O), unit-tested in tests/bench/.

Definitions (times are ``time.perf_counter()`` seconds):
- TTFT: first chunk that carried at least one token minus the send time.
- ITL: gap between consecutive token-carrying chunks, split evenly over the tokens the later chunk
  carries (tokens of the first chunk are covered by TTFT).
- E2E: end of stream minus send time.
- prefix-cache hit rate: sum(cached_tokens) / sum(prompt_tokens) as the server reports them.
- lengths: uniform integers in ``[L*(1-r), L*(1+r)]``, at least 1.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestSpec:
    prompt_ids: list[int]
    output_len: int
    prefix_group: int | None = None


@dataclass
class RequestResult:
    """Outcome of one request; times are ``time.perf_counter()`` seconds."""

    success: bool = False
    error: str = ""
    start: float = 0.0
    end: float = 0.0
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival time, new tokens)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default method); NaN for no values."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize_ms(values_s: Sequence[float]) -> dict[str, float]:
    """mean / median / p90 / p99 of durations given in seconds, reported in milliseconds."""
    ms = [v * 1000.0 for v in values_s]
    mean = sum(ms) / len(ms) if ms else math.nan
    return {"mean": mean, "median": percentile(ms, 50), "p90": percentile(ms, 90), "p99": percentile(ms, 99)}


def ttft_from_chunks(start: float, chunks: Sequence[tuple[float, int]]) -> float | None:
    """Seconds from send to the first chunk that carried at least one token (None if none did)."""
    for t, n in chunks:
        if n > 0:
            return t - start
    return None


def itls_from_chunks(chunks: Sequence[tuple[float, int]]) -> list[float]:
    """Inter-token latencies: each gap between token-carrying chunks, split evenly over the later
    chunk's tokens (a chunk of n tokens contributes n equal entries). Tokens in the first chunk are
    covered by TTFT and contribute none."""
    token_chunks = [(t, n) for t, n in chunks if n > 0]
    out: list[float] = []
    for (t0, _), (t1, n1) in zip(token_chunks, token_chunks[1:], strict=False):
        out.extend([(t1 - t0) / n1] * n1)
    return out


def prefix_hit_rate(cached_tokens: Sequence[int], prompt_tokens: Sequence[int]) -> float:
    """sum(cached) / sum(prompt); 0.0 when no prompt tokens were reported."""
    total = sum(prompt_tokens)
    return sum(cached_tokens) / total if total > 0 else 0.0


def sample_lengths(rng: random.Random, mean: int, range_ratio: float, n: int) -> list[int]:
    """n lengths uniform in [mean*(1-r), mean*(1+r)] (integers, at least 1)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    lo = max(1, int(mean * (1.0 - range_ratio)))
    hi = max(lo, int(mean * (1.0 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def poisson_gaps(rng: random.Random, rate: float, n: int) -> list[float]:
    """Seconds to wait before sending each of n requests: 0 first, then exponential(rate); all 0 for inf."""
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {rate}")
    return [0.0] + [rng.expovariate(rate) for _ in range(n - 1)]


def build_requests(
    rng: random.Random,
    *,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    shared_prefix_len: int,
    num_prefix_groups: int,
    vocab_size: int,
) -> list[RequestSpec]:
    """The workload, fully determined by the arguments and the rng state. With shared_prefix_len > 0,
    request i gets prefix group i % num_prefix_groups and then a random suffix of input_len-distributed
    length (at least 1 token, so suffixes differ)."""

    def draw(k: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(k)]

    prefixes = [draw(shared_prefix_len) for _ in range(num_prefix_groups)] if shared_prefix_len else []
    in_lens = sample_lengths(rng, input_len, range_ratio, num_prompts)
    out_lens = sample_lengths(rng, output_len, range_ratio, num_prompts)
    specs = []
    for i, (li, lo) in enumerate(zip(in_lens, out_lens, strict=True)):
        group = i % len(prefixes) if prefixes else None
        prefix = prefixes[group] if group is not None else []
        specs.append(RequestSpec(prompt_ids=prefix + draw(li), output_len=lo, prefix_group=group))
    return specs


def find_vocab_size(info: object, keys: tuple[str, ...] = ("vocab_size", "n_vocab")) -> int | None:
    """The first positive integer under one of `keys` found anywhere in a JSON document
    (hyssm/SGLang /get_server_info: ``vocab_size``; llama-server /v1/models: ``meta.n_vocab``)."""
    if isinstance(info, dict):
        for key in keys:
            value = info.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        children: list[object] = list(info.values())
    elif isinstance(info, list):
        children = list(info)
    else:
        return None
    for child in children:
        found = find_vocab_size(child, keys)
        if found is not None:
            return found
    return None


def compute_metrics(results: Sequence[RequestResult], duration_s: float) -> dict[str, object]:
    """Aggregate per-request results of one run (failed requests count only in ``failed``)."""
    ok = [r for r in results if r.success]
    ttfts = [x for x in (ttft_from_chunks(r.start, r.chunks) for r in ok) if x is not None]
    itls = [x for r in ok for x in itls_from_chunks(r.chunks)]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.completion_tokens for r in ok)
    total_cached = sum(r.cached_tokens for r in ok)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: math.nan)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "total_cached_tokens": total_cached,
        "prefill_tokens_computed": total_in - total_cached,
        "prefix_cache_hit_rate": prefix_hit_rate([r.cached_tokens for r in ok], [r.prompt_tokens for r in ok]),
        "request_throughput": per_s(len(ok)),
        "input_token_throughput": per_s(total_in),
        "output_token_throughput": per_s(total_out),
        "ttft_ms": summarize_ms(ttfts),
        "itl_ms": summarize_ms(itls),
        "e2e_ms": summarize_ms([r.end - r.start for r in ok]),
        "errors": sorted({r.error for r in results if not r.success})[:10],
    }


def median_metrics(runs: Sequence[dict[str, object]]) -> dict[str, object]:
    """Per-key median of several compute_metrics() dicts (nested dicts too); ``errors`` is the union."""
    out: dict[str, object] = {}
    for key, first in runs[0].items():
        values = [r[key] for r in runs]
        if key == "errors":
            out[key] = sorted({e for v in values if isinstance(v, list) for e in v})[:10]
        elif isinstance(first, dict):
            out[key] = median_metrics([v for v in values if isinstance(v, dict)])
        elif isinstance(first, (int, float)) and not isinstance(first, bool):
            nums = [float(v) for v in values if isinstance(v, (int, float))]
            finite = [v for v in nums if not math.isnan(v)]
            out[key] = statistics.median(finite) if finite else math.nan
        else:
            out[key] = first
    return out


def json_safe(obj: object) -> object:
    """obj with every NaN/inf float replaced by None, so the JSON output is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def format_report(m: dict[str, object], title: str = "Serving Benchmark Result") -> str:
    """The human-readable table printed on stdout."""
    rows: list[tuple[str, object]] = [
        ("Successful requests", m["completed"]),
        ("Failed requests", m["failed"]),
        ("Benchmark duration (s)", f"{m['duration_s']:.2f}"),
        ("Total input tokens", m["total_input_tokens"]),
        ("Total output tokens", m["total_output_tokens"]),
        ("Cached prompt tokens (prefill saved)", m["total_cached_tokens"]),
        ("Prefix cache hit rate", f"{m['prefix_cache_hit_rate']:.2%}"),
        ("Request throughput (req/s)", f"{m['request_throughput']:.2f}"),
        ("Input token throughput (tok/s)", f"{m['input_token_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{m['output_token_throughput']:.2f}"),
    ]
    if "server_prefix_hit_rate" in m:
        rate = m["server_prefix_hit_rate"]
        shown = f"{rate:.2%}" if isinstance(rate, float) and math.isfinite(rate) else "n/a"
        rows.append(("Prefix hit rate (server /metrics)", shown))
    accept = m.get("server_spec_accept_length")
    if isinstance(accept, float) and math.isfinite(accept):
        rows.append(("Tokens per verify step (speculative)", f"{accept:.2f}"))
    routed = m.get("replica_requests")
    if isinstance(routed, dict) and routed:
        rows.append(("Requests per replica", " ".join(f"{v:g}" for _, v in sorted(routed.items()))))
    for key, name in (("ttft_ms", "TTFT (ms)"), ("itl_ms", "ITL (ms)"), ("e2e_ms", "E2E latency (ms)")):
        stats = m[key]
        assert isinstance(stats, dict)
        rows.extend((f"{stat.capitalize()} {name}", f"{stats[stat]:.2f}") for stat in ("mean", "median", "p90", "p99"))
    width = 50
    lines = [f" {title} ".center(width, "="), *(f"{k + ':':<38}{v!s:>12}" for k, v in rows), "=" * width]
    return "\n".join(lines)


def apply_chunk(backend: str, chunk: object, res: RequestResult, now: float) -> None:
    """Record one decoded SSE chunk into res (token arrival and the server-reported counts).

    hyssm (alias generate): new tokens = growth of the cumulative ``meta_info.completion_tokens``.
    llama-server (native /completion): growth of the cumulative ``tokens_predicted``; prompt and
    cached counts from ``tokens_evaluated`` and ``timings.cache_n``. openai: every choice chunk
    without finish_reason (or with text) carries one token; ``usage`` sets the totals.
    Raises RuntimeError on an error chunk or a malformed one (the caller records a failure)."""
    if not isinstance(chunk, dict):
        raise RuntimeError(f"stream chunk is not an object: {chunk!r:.100}")
    if "error" in chunk:
        raise RuntimeError(f"server error in stream: {chunk['error']}")
    if backend in ("hyssm", "generate"):
        meta = chunk.get("meta_info") or {}
        if not isinstance(meta, dict):
            raise RuntimeError(f"meta_info is not an object: {meta!r:.100}")
        _count_cumulative(res, now, int(meta.get("completion_tokens", res.completion_tokens + 1)))
        res.prompt_tokens = int(meta.get("prompt_tokens", res.prompt_tokens))
        res.cached_tokens = int(meta.get("cached_tokens", res.cached_tokens))
        return
    if backend == "llama-server":
        if "tokens_predicted" not in chunk and not chunk.get("stop"):
            raise RuntimeError(f"not a llama-server /completion chunk: {chunk!r:.100}")
        _count_cumulative(res, now, int(chunk.get("tokens_predicted", res.completion_tokens)))
        res.prompt_tokens = int(chunk.get("tokens_evaluated", res.prompt_tokens))
        timings = chunk.get("timings")
        if isinstance(timings, dict) and "cache_n" in timings:
            res.cached_tokens = int(timings["cache_n"])
        return
    _apply_openai_chunk(chunk, res, now)


def _count_cumulative(res: RequestResult, now: float, done: int) -> None:
    res.chunks.append((now, max(0, done - res.completion_tokens)))
    res.completion_tokens = max(done, res.completion_tokens)


def _apply_openai_chunk(chunk: dict, res: RequestResult, now: float) -> None:
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        res.prompt_tokens = int(usage.get("prompt_tokens", 0))
        res.completion_tokens = int(usage.get("completion_tokens", 0))
        details = usage.get("prompt_tokens_details") or {}
        res.cached_tokens = int(details.get("cached_tokens", 0) if isinstance(details, dict) else 0)
    choices = chunk.get("choices") or []
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        choice = choices[0]
        # A chunk still in progress (no finish_reason) carries one token even if its text is held back.
        if choice.get("finish_reason") is None or choice.get("text"):
            res.chunks.append((now, 1))
            if not isinstance(usage, dict):  # usage (final chunk) overrides this running count
                res.completion_tokens += 1
