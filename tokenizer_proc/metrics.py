"""/metrics: Prometheus text rendered from the scheduler's `info()["metrics"]` plus this layer's
own HTTP counters, through a fresh CollectorRegistry per scrape (no prometheus globals).

Scheduler metrics come as a list of `{"name", "type": "counter"|"gauge", "help", "labels", "value"}`
items (several items may share a name with different labels), or, in the older form, as a dict
`{'name{label="v"}': value}` rendered as gauges.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_KEYED = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?$')
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


@dataclass
class HttpMetrics:
    """Counters of the HTTP layer. Owned by the app's context; updated by its middleware."""

    requests: Counter[tuple[str, int]] = field(default_factory=Counter)
    bad_requests: Counter[str] = field(default_factory=Counter)

    def record(self, endpoint: str, status: int) -> None:
        self.requests[(endpoint, status)] += 1
        if 400 <= status < 500:
            self.bad_requests[endpoint] += 1

    def check_integrity(self) -> None:
        assert all(v > 0 for v in self.requests.values())
        for endpoint, n in self.bad_requests.items():
            assert n == sum(v for (e, s), v in self.requests.items() if e == endpoint and 400 <= s < 500)


class _HttpCollector(Collector):
    def __init__(self, metrics: HttpMetrics, in_flight: int, healthy: bool):
        self._metrics, self._in_flight, self._healthy = metrics, in_flight, healthy

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


def _parse_keyed(key: str) -> tuple[str, dict[str, str]] | None:
    m = _KEYED.match(key.strip())
    if m is None:
        return None
    labels = {k: v for k, v in _LABEL.findall(m.group(2) or "")}
    return m.group(1), labels


def normalise_items(raw: Any) -> list[dict[str, Any]]:
    """Scheduler metrics in either form -> list of items; malformed entries are skipped."""
    if isinstance(raw, dict):
        items = []
        for key, value in raw.items():
            parsed = _parse_keyed(str(key))
            if parsed is not None:
                items.append({"name": parsed[0], "type": "gauge", "help": "", "labels": parsed[1], "value": value})
        raw = items
    out = []
    for item in raw if isinstance(raw, list) else []:
        if not isinstance(item, dict) or not _NAME.match(str(item.get("name", ""))):
            continue
        if isinstance(item.get("value"), bool) or not isinstance(item.get("value"), (int, float)):
            continue
        out.append(item)
    return out


class SchedulerCollector(Collector):
    """Renders scheduler metric items; items sharing a name form one family."""

    def __init__(self, items: Iterable[dict[str, Any]]):
        self._items = list(items)

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        label_names: dict[str, list[str]] = {}
        for item in self._items:
            name = str(item["name"])
            labels = {str(k): str(v) for k, v in (item.get("labels") or {}).items()}
            fam = families.get(name)
            if fam is None:
                label_names[name] = sorted(labels)
                cls = CounterMetricFamily if item.get("type") == "counter" else GaugeMetricFamily
                fam = families[name] = cls(name, str(item.get("help") or name), labels=label_names[name])
            fam.add_metric([labels.get(k, "") for k in label_names[name]], float(item["value"]))
        yield from families.values()


def render_metrics(http: HttpMetrics, scheduler_metrics: Any, in_flight: int, healthy: bool) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_HttpCollector(http, in_flight, healthy))
    if scheduler_metrics is not None:
        registry.register(SchedulerCollector(normalise_items(scheduler_metrics)))
    return generate_latest(registry)
