"""Request latency histograms for /metrics: time to first token, inter-token latency, time per
output token and end-to-end latency, measured in this process (what a client sees, minus HTTP).

Rules: the clock starts when the request has been prepared and is about to be submitted; TTFT is
observed at the first piece that carries a token; every later piece with k tokens observes its gap
since the previous one, divided by k, k times (inter-token latency); at the finish the e2e latency
and, with at least two tokens, TPOT = (finish - first token) / (tokens - 1). The queue time is the
scheduler's own measure (arrival to first admission into a batch), told with the first token. A
request that ends without a finish (client gone) records only what it reached.
"""

from __future__ import annotations

import bisect
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenizer_proc.requests.generation import Piece

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0)


@dataclass
class Histogram:
    """Cumulative-on-render bucket counts (`counts[i]`: observations <= buckets[i], not cumulative)."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.total += value * times
        self.n += times

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        cum, rows = 0, []
        for bound, c in zip((*self.buckets, float("inf")), self.counts, strict=True):
            cum += c
            rows.append(("+Inf" if bound == float("inf") else repr(bound), cum))
        return HistogramMetricFamily(name, doc, buckets=rows, sum_value=self.total)


@dataclass
class LatencyStats:
    """The histograms of one app (owned by its AppContext)."""

    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    queue: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))

    async def timed(self, pieces: AsyncIterator[Piece]) -> AsyncIterator[Piece]:
        """`pieces`, observing the request's latencies as they pass (module doc)."""
        start = last = time.monotonic()
        first: float | None = None
        tokens = 0
        async with contextlib.aclosing(pieces) as it:  # type: ignore[type-var]
            async for piece in it:
                now = time.monotonic()
                n = len(piece.token_ids)
                if piece.queue_s >= 0:
                    self.queue.observe(piece.queue_s)
                if n and first is None:
                    first = now
                    self.ttft.observe(now - start)
                elif n:
                    self.itl.observe((now - last) / n, n)
                if n:
                    last, tokens = now, tokens + n
                if piece.finish is not None:
                    self.e2e.observe(now - start)
                    if first is not None and tokens > 1:
                        self.tpot.observe((now - first) / (tokens - 1))
                yield piece


class LatencyCollector(Collector):
    def __init__(self, stats: LatencyStats) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats
        yield s.ttft.family("hyssm_time_to_first_token_seconds", "time from submission to the first token")
        yield s.itl.family("hyssm_inter_token_latency_seconds", "time between consecutive output tokens")
        yield s.tpot.family("hyssm_time_per_output_token_seconds", "per request: (finish - first token) / (tokens - 1)")
        yield s.e2e.family("hyssm_e2e_request_latency_seconds", "time from submission to the finish")
        yield s.queue.family("hyssm_queue_time_seconds", "time a request waited in the scheduler's queue for "
                             "its first admission")  # fmt: skip
