"""SGLang-compatible series on /metrics: the quantities hyssm has, under the names, types and
`model_name` label of SGLang's metrics collectors, so dashboards and autoscalers built for SGLang read
a hyssm server.

`SGLANG_METRICS` is the one table that decides the mapping. Each row is computed, at scrape time,
from the hyssm families of the same scrape (`sglang_families`), so an sglang value is always the
number its hyssm counterpart shows (or a ratio of them) and nothing is counted twice. A row whose
hyssm samples are absent from the scrape (the scheduler did not answer) is left out, not zeroed.

Rates, histograms and ratios keep hyssm's meaning where SGLang's differs in detail:
- histograms carry hyssm's buckets (SGLang's earlier defaults; `histogram_quantile` reads any);
- `sglang:cache_hit_rate`, `sglang:spec_accept_length` and `sglang:spec_accept_rate` are ratios of
  counters since the server started (SGLang's cover its last logging interval);
- `sglang:gen_throughput` is the rate of generated tokens between scrapes (`RateWindow`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

logger = logging.getLogger(__name__)

RATE_WINDOW_S = 10.0


class MissingSample(LookupError):
    """A row reads a hyssm sample the scrape does not have."""


@dataclass
class RateWindow:
    """Per-second rate of a counter seen at successive scrapes: its increase since the oldest sample
    kept, over the time between them. Kept are the samples of the last `window_s` seconds and always
    the one before the latest, so the rate spans max(window_s, the scrape interval); 0.0 until two
    samples at different times exist. A value below the previous one (a restart) starts over."""

    window_s: float = RATE_WINDOW_S
    samples: deque[tuple[float, float]] = field(default_factory=deque)

    def observe(self, now: float, value: float) -> float:
        if self.samples and (value < self.samples[-1][1] or now < self.samples[-1][0]):
            self.samples.clear()
        self.samples.append((now, value))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window_s:
            self.samples.popleft()
        t0, v0 = self.samples[0]
        return (value - v0) / (now - t0) if now > t0 else 0.0


class Samples:
    """The samples of one scrape's hyssm families, by sample name (a counter's ends in `_total`),
    and the rate windows of the app (`rates`, updated at time `now`)."""

    def __init__(self, families: Iterable[Metric], rates: dict[str, RateWindow], now: float) -> None:
        self.families = {m.name: m for m in families}
        self.by_name: dict[str, list[tuple[dict[str, str], float]]] = {}
        for m in self.families.values():
            for s in m.samples:
                self.by_name.setdefault(s.name, []).append((s.labels, s.value))
        self.rates, self.now = rates, now

    def total(self, name: str, labels: dict[str, str]) -> float:
        """Sum of the samples named `name` that carry `labels`."""
        if name not in self.by_name:
            raise MissingSample(name)
        return sum(v for lab, v in self.by_name[name] if all(lab.get(k) == x for k, x in labels.items()))

    def rate(self, key: str, value: float) -> float:
        return self.rates.setdefault(key, RateWindow()).observe(self.now, value)


class Expr(Protocol):
    """A value computed from a scrape's hyssm samples; str() gives it in PromQL-like words."""

    def __call__(self, s: Samples) -> float: ...


@dataclass(frozen=True)
class Sample:
    """The hyssm samples named `name` carrying `labels`, summed (a histogram row: the family)."""

    name: str
    labels: dict[str, str] = field(default_factory=dict)

    def __call__(self, s: Samples) -> float:
        return s.total(self.name, self.labels)

    def __str__(self) -> str:
        sel = ",".join(f'{k}="{v}"' for k, v in self.labels.items())
        return f"{self.name}{{{sel}}}" if sel else self.name


@dataclass(frozen=True)
class Minus:
    """`base` less each of `parts`."""

    base: Expr
    parts: tuple[Expr, ...]

    def __call__(self, s: Samples) -> float:
        return self.base(s) - sum(p(s) for p in self.parts)

    def __str__(self) -> str:
        return " - ".join(str(e) for e in (self.base, *self.parts))


@dataclass(frozen=True)
class Ratio:
    """`plus` + num / den, or 0.0 while den is 0."""

    num: Expr
    den: Expr
    plus: float = 0.0

    def __call__(self, s: Samples) -> float:
        num, den = self.num(s), self.den(s)
        return self.plus + num / den if den else 0.0

    def __str__(self) -> str:
        num = f"({self.num})" if isinstance(self.num, Minus) else str(self.num)
        return f"{self.plus:g} + {num} / {self.den}" if self.plus else f"{num} / {self.den}"


@dataclass(frozen=True)
class Rate:
    """Per-second rate of the counter `of` between scrapes (RateWindow)."""

    of: Expr

    def __call__(self, s: Samples) -> float:
        return s.rate(str(self.of), self.of(s))

    def __str__(self) -> str:
        return f"rate({self.of}) over the last {RATE_WINDOW_S:g} s of scrapes"


Kind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True)
class SglangMetric:
    """One sglang series: `name` as exposed, `kind`, `help`, and `source`, what it maps from (a
    histogram's is the hyssm histogram whose buckets, sum and count it repeats)."""

    name: str
    kind: Kind
    help: str
    source: Expr

    def family(self, s: Samples, model_name: str) -> Metric:
        """The family with the one label model_name; raises MissingSample."""
        if self.kind == "histogram":
            assert isinstance(self.source, Sample)
            src = s.families.get(self.source.name)
            if src is None:
                raise MissingSample(self.source.name)
            fam = Metric(self.name, self.help, "histogram")
            for smp in src.samples:
                fam.add_sample(self.name + smp.name[len(src.name):], {**smp.labels, "model_name": model_name},
                               smp.value)
            return fam
        value = float(self.source(s))
        cls = CounterMetricFamily if self.kind == "counter" else GaugeMetricFamily
        fam = cls(self.name.removesuffix("_total") if self.kind == "counter" else self.name, self.help,
                  labels=["model_name"])
        fam.add_metric([model_name], value)
        return fam


def _kv(state: str) -> Sample:
    return Sample("hyssm_kv_slots", {"state": state})


def _mamba(state: str) -> Sample:
    return Sample("hyssm_mamba_slots", {"state": state})


_KV_USED = Minus(Sample("hyssm_kv_slots_capacity"), (_kv("free"), Sample("hyssm_kv_slots_evictable")))
_MAMBA_USED = Minus(Sample("hyssm_mamba_slots_capacity"), (_mamba("free"), Sample("hyssm_mamba_slots_evictable")))
_STATE_HITS = Sample("hyssm_prefix_cache_hit_tokens_total", {"kind": "state"})
_GENERATED = Sample("hyssm_generated_tokens_total")

SGLANG_METRICS: tuple[SglangMetric, ...] = (
    # counters: prompt tokens are counted (cached ones included) at a request's first admission
    SglangMetric("sglang:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
                 Sample("hyssm_prefix_cache_queried_tokens_total")),
    SglangMetric("sglang:generation_tokens_total", "counter", "Number of generation tokens processed.", _GENERATED),
    SglangMetric("sglang:cached_tokens_total", "counter", "Number of cached prompt tokens.", _STATE_HITS),
    SglangMetric("sglang:num_requests_total", "counter", "Number of requests processed.",
                 Sample("hyssm_requests_finished_total")),
    SglangMetric("sglang:num_aborted_requests_total", "counter", "Number of requests aborted.",
                 Sample("hyssm_requests_finished_total", {"reason": "abort"})),
    SglangMetric("sglang:num_retracted_requests_total", "counter", "Total number of retracted requests.",
                 Sample("hyssm_retractions_total")),
    # gauges of the live state
    SglangMetric("sglang:num_running_reqs", "gauge", "The number of running requests.",
                 Sample("hyssm_num_running_reqs")),
    SglangMetric("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting queue.",
                 Sample("hyssm_num_waiting_reqs")),
    SglangMetric("sglang:max_total_num_tokens", "gauge", "Maximum total number of tokens in the KV cache pool.",
                 Sample("hyssm_kv_slots_capacity")),
    SglangMetric("sglang:num_used_tokens", "gauge", "The number of used tokens.", _KV_USED),
    SglangMetric("sglang:token_usage", "gauge", "The token usage.", Ratio(_KV_USED, Sample("hyssm_kv_slots_capacity"))),
    SglangMetric("sglang:mamba_usage", "gauge", "The token usage for Mamba layers.",
                 Ratio(_MAMBA_USED, Sample("hyssm_mamba_slots_capacity"))),
    SglangMetric("sglang:new_token_ratio", "gauge", "The new token ratio.", Sample("hyssm_new_token_ratio")),
    # ratios since start, and the one rate
    SglangMetric("sglang:cache_hit_rate", "gauge", "The prefix cache hit rate.",
                 Ratio(_STATE_HITS, Sample("hyssm_prefix_cache_queried_tokens_total"))),
    SglangMetric("sglang:spec_accept_length", "gauge", "The average acceptance length of speculative decoding.",
                 Ratio(Sample("hyssm_spec_accepted_tokens_total"), Sample("hyssm_spec_verify_steps_total"), 1.0)),
    SglangMetric("sglang:spec_accept_rate", "gauge", "The average acceptance rate of speculative decoding.",
                 Ratio(Sample("hyssm_spec_accepted_tokens_total"), Sample("hyssm_spec_draft_tokens_total"))),
    SglangMetric("sglang:gen_throughput", "gauge", "The generation throughput (token/s).", Rate(_GENERATED)),
    # latency histograms of the HTTP layer
    SglangMetric("sglang:time_to_first_token_seconds", "histogram", "Histogram of time to first token in seconds.",
                 Sample("hyssm_time_to_first_token_seconds")),
    SglangMetric("sglang:inter_token_latency_seconds", "histogram", "Histogram of inter-token latency in seconds.",
                 Sample("hyssm_inter_token_latency_seconds")),
    SglangMetric("sglang:time_per_output_token_seconds", "histogram",
                 "Histogram of time per output token in seconds.", Sample("hyssm_time_per_output_token_seconds")),
    SglangMetric("sglang:e2e_request_latency_seconds", "histogram",
                 "Histogram of End-to-end request latency in seconds", Sample("hyssm_e2e_request_latency_seconds")),
    SglangMetric("sglang:queue_time_seconds", "histogram", "Histogram of queueing time in seconds.",
                 Sample("hyssm_queue_time_seconds")),
)


def sglang_families(families: Iterable[Metric], model_name: str, rates: dict[str, RateWindow],
                    now: float) -> Iterator[Metric]:
    """The SGLANG_METRICS families computed from one scrape's hyssm `families` (those whose samples
    are there), each labelled model_name=`model_name`."""
    samples = Samples(families, rates, now)
    for row in SGLANG_METRICS:
        try:
            yield row.family(samples, model_name)
        except MissingSample as e:
            logger.debug("/metrics without %s: no %s in this scrape", row.name, e)


def mapping_table() -> list[tuple[str, str, str]]:
    """(sglang name, kind, what it maps from) of every row, in table order."""
    return [(row.name, row.kind, str(row.source)) for row in SGLANG_METRICS]
