"""/metrics: Prometheus text rendered from the scheduler's MetricRecords (SchedulerInfo.metrics,
shared/messages.py: names already validated when the message was decoded) plus this layer's own HTTP
counters and latency histograms, through a fresh CollectorRegistry per scrape (no prometheus globals).
The same quantities are also rendered under SGLang's names with a `model_name` label
(tokenizer_proc/sglang_metrics.py); the hyssm_* series carry no model label.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from shared.messages import MetricRecord
from tokenizer_proc.sglang_metrics import RateWindow, sglang_families

logger = logging.getLogger(__name__)


@dataclass
class HttpMetrics:
    """Counters of the HTTP layer: one per app (in its context), updated only by its middleware;
    `rates`: the windows of the rates /metrics computes between scrapes (sglang:gen_throughput)."""

    requests: Counter[tuple[str, int]] = field(default_factory=Counter)
    bad_requests: Counter[str] = field(default_factory=Counter)
    rates: dict[str, RateWindow] = field(default_factory=dict)

    def record(self, endpoint: str, status: int) -> None:
        self.requests[(endpoint, status)] += 1
        if 400 <= status < 500:
            self.bad_requests[endpoint] += 1

    def check_integrity(self) -> None:
        assert all(v > 0 for v in self.requests.values())
        for endpoint, n in self.bad_requests.items():
            assert n == sum(v for (e, s), v in self.requests.items() if e == endpoint and 400 <= s < 500)


REFUSAL_REASONS = ("queue_full", "draining")  # tokenizer_proc/requests/admission.py


@dataclass(frozen=True)
class AdmissionSample:
    """The admission state at a scrape: choices admitted beyond the running slots, refusals by reason."""

    queued: int = 0
    refused: Mapping[str, int] = field(default_factory=dict)


class _HttpCollector(Collector):
    def __init__(self, metrics: HttpMetrics, in_flight: int, healthy: bool, admission: AdmissionSample):
        self._metrics, self._in_flight, self._healthy = metrics, in_flight, healthy
        self._admission = admission

    def _admission_families(self) -> Iterator[Metric]:
        queued_help = "generation requests admitted beyond the running slots (--max-running-requests per replica)"
        yield GaugeMetricFamily("hyssm_http_queued_requests", queued_help, value=self._admission.queued)
        refused_help = "generation requests answered 503 before their response started, by reason"
        refused = CounterMetricFamily("hyssm_http_refused_requests", refused_help, labels=["reason"])
        for reason in REFUSAL_REASONS:
            refused.add_metric([reason], self._admission.refused.get(reason, 0))
        yield refused

    def collect(self) -> Iterator[Metric]:
        reqs = CounterMetricFamily("hyssm_http_requests", "HTTP requests by endpoint and status",
                                   labels=["endpoint", "status"])
        for (endpoint, status), n in sorted(self._metrics.requests.items()):
            reqs.add_metric([endpoint, str(status)], n)
        yield reqs
        bad = CounterMetricFamily("hyssm_http_bad_requests", "HTTP requests answered 4xx", labels=["endpoint"])
        for endpoint, n in sorted(self._metrics.bad_requests.items()):
            bad.add_metric([endpoint], n)
        yield bad
        yield GaugeMetricFamily("hyssm_http_in_flight_requests", "generation requests in flight",
                                value=self._in_flight)
        yield GaugeMetricFamily("hyssm_scheduler_up", "1 when the scheduler answers", value=int(self._healthy))
        yield from self._admission_families()


class SchedulerCollector(Collector):
    """Renders scheduler records; records sharing a name form one family (the first one's type, help
    and label names)."""

    def __init__(self, records: Iterable[MetricRecord]):
        self._records = list(records)

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        label_names: dict[str, list[str]] = {}
        histograms: dict[str, list[MetricRecord]] = {}
        for rec in self._records:
            if rec.type == "histogram":
                histograms.setdefault(rec.name, []).append(rec)
                continue
            fam = families.get(rec.name)
            if fam is None:
                label_names[rec.name] = sorted(rec.labels)
                cls = CounterMetricFamily if rec.type == "counter" else GaugeMetricFamily
                fam = families[rec.name] = cls(rec.name, rec.help or rec.name, labels=label_names[rec.name])
            fam.add_metric([rec.labels.get(k, "") for k in label_names[rec.name]], float(rec.value))
        yield from families.values()
        for name, recs in histograms.items():
            buckets = [(r.labels["le"], float(r.value)) for r in recs if r.labels.get("le") != "sum"]
            total = sum(float(r.value) for r in recs if r.labels.get("le") == "sum")
            buckets.sort(key=lambda b: float(b[0]))
            yield HistogramMetricFamily(name, recs[0].help or name, buckets=buckets, sum_value=total)


class _Families(Collector):
    def __init__(self, families: list[Metric]):
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families


def render_metrics(
    http: HttpMetrics, scheduler_metrics: list[MetricRecord] | None, in_flight: int, healthy: bool,
    latency: Collector | None = None, *, model_name: str, now: float | None = None,
    admission: AdmissionSample | None = None,
) -> bytes:
    """The hyssm_* families (HTTP, admission, latency, scheduler records when given), then their sglang
    counterparts labelled model_name=`model_name`; `now` (monotonic seconds) times the rates."""
    sources: list[Collector] = [_HttpCollector(http, in_flight, healthy, admission or AdmissionSample())]
    if latency is not None:
        sources.append(latency)
    if scheduler_metrics is not None:
        sources.append(SchedulerCollector(scheduler_metrics))
    hyssm = [m for c in sources for m in c.collect()]
    sglang = sglang_families(hyssm, model_name, http.rates, time.monotonic() if now is None else now)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families([*hyssm, *sglang]))
    return generate_latest(registry)
