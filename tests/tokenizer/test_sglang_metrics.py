"""The SGLang-compatible series of /metrics (tokenizer_proc/sglang_metrics.py) and the Grafana
dashboard (dashboards/hyssm-grafana.json): rendered from a real scheduler's records and real latency
histograms, every sglang value carries model_name and equals its hyssm counterpart; every name the
dashboard's PromQL reads is one a render exports."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks import grafana_dashboard
from shared.messages import MetricRecord, SchedulerInfo
from tests.scheduler import harness
from tests.scheduler.fake_worker import FakeWorker
from tests.scheduler.util import greq, make
from tokenizer_proc.metrics import HttpMetrics, render_metrics
from tokenizer_proc.requests.latency import LatencyCollector, LatencyStats
from tokenizer_proc.sglang_metrics import SGLANG_METRICS, RateWindow

ROOT = Path(__file__).resolve().parents[2]
MODEL = "org/granite-test"
HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds", "time_per_output_token_seconds",
              "e2e_request_latency_seconds", "queue_time_seconds")  # fmt: skip

Key = tuple[str, frozenset[tuple[str, str]]]


class RepeatingWorker(FakeWorker):
    """Continues the period-5 pattern of the sequence, so n-gram drafts are mostly accepted."""

    def next_token(self, seq: tuple[int, ...]) -> int:
        return seq[len(seq) - 5]


@pytest.fixture(scope="module")
def info() -> SchedulerInfo:
    """A real scheduler's info mid-run: requests running and waiting, prefix hits, verified drafts."""
    sched, _ = make(kv=512, states=8, max_running_requests=2, speculative_algorithm="NGRAM",
                    speculative_num_draft_tokens=4)  # fmt: skip
    shared = [(7 * j) % 50 for j in range(5)] * 4
    arrivals = {0: [greq(f"a{i}", shared + [i, i + 1, i + 2, i + 3, i + 4], 12) for i in range(3)],
                12: [greq(f"b{i}", shared + [i + 9] * 5, 12) for i in range(3)]}  # fmt: skip
    seen: list[SchedulerInfo] = []

    def look(rnd: int, s: object) -> None:
        got = sched.info()
        if got.server.num_running and got.server.num_waiting:
            seen.append(got)

    harness.run(sched, RepeatingWorker(512, 8), arrivals, on_round=look)
    return seen[-1]


def _latency() -> LatencyStats:
    stats = LatencyStats()
    for ttft, gaps in ((0.03, [0.011, 0.012]), (0.4, [0.02, 0.05, 0.009]), (2.1, [])):
        stats.ttft.observe(ttft)
        for g in gaps:
            stats.itl.observe(g / 2, 2)
        if gaps:
            stats.tpot.observe(sum(gaps) / (2 * len(gaps)))
        stats.e2e.observe(ttft + sum(gaps))
        stats.queue.observe(ttft / 3)
    return stats


def _samples(text: str) -> dict[Key, float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}  # fmt: skip


def _http() -> HttpMetrics:
    http = HttpMetrics()
    for endpoint, status in (("/generate", 200), ("/v1/chat/completions", 200), ("/v1/completions", 400)):
        http.record(endpoint, status)
    return http


def _render(records: list[MetricRecord] | None, http: HttpMetrics | None = None, now: float = 100.0) -> str:
    http = http or _http()
    return render_metrics(http, records, 2, True, LatencyCollector(_latency()), model_name=MODEL,
                          now=now).decode()  # fmt: skip


def _get(samples: dict[Key, float], name: str, **labels: str) -> float:
    """The sum of the samples named `name` carrying `labels` (present at least once)."""
    hits = [v for (n, lab), v in samples.items() if n == name and set(labels.items()) <= lab]
    assert hits, f"no {name}{labels}"
    return sum(hits)


def test_sglang_series_carry_model_name_and_the_hyssm_numbers(info: SchedulerInfo) -> None:
    s = _samples(_render(info.metrics))
    sglang = {k: v for k, v in s.items() if k[0].startswith("sglang:")}
    assert sglang and all(("model_name", MODEL) in lab for _, lab in sglang)
    assert not any(("model_name", MODEL) in lab for n, lab in s if n.startswith("hyssm_"))

    def sg(name: str) -> float:
        return _get(s, name, model_name=MODEL)

    def hy(name: str, **labels: str) -> float:
        return _get(s, name, **labels)

    srv = info.server
    assert srv.num_running > 0 and srv.num_waiting > 0 and srv.prefix_state_hit_tokens > 0
    assert sg("sglang:num_running_reqs") == hy("hyssm_num_running_reqs") == srv.num_running
    assert sg("sglang:num_queue_reqs") == hy("hyssm_num_waiting_reqs") == srv.num_waiting
    assert sg("sglang:generation_tokens_total") == hy("hyssm_generated_tokens_total") > 0
    assert sg("sglang:prompt_tokens_total") == hy("hyssm_prefix_cache_queried_tokens_total") == \
        srv.prefix_queried_tokens
    assert sg("sglang:cached_tokens_total") == hy("hyssm_prefix_cache_hit_tokens_total", kind="state") == \
        srv.prefix_state_hit_tokens
    assert sg("sglang:num_requests_total") == hy("hyssm_requests_finished_total") > 0
    assert sg("sglang:num_aborted_requests_total") == hy("hyssm_requests_finished_total", reason="abort")
    assert sg("sglang:num_retracted_requests_total") == hy("hyssm_retractions_total")
    assert sg("sglang:max_total_num_tokens") == hy("hyssm_kv_slots_capacity") == srv.kv_capacity
    used = srv.kv_capacity - srv.kv_free - srv.kv_evictable
    assert sg("sglang:num_used_tokens") == used > 0
    assert sg("sglang:token_usage") == pytest.approx(used / srv.kv_capacity)
    st_used = srv.state_capacity - srv.state_free - srv.state_evictable
    assert st_used > 0 and sg("sglang:mamba_usage") == pytest.approx(st_used / srv.state_capacity)
    assert srv.prefix_state_hit_rate > 0 and sg("sglang:cache_hit_rate") == pytest.approx(srv.prefix_state_hit_rate)
    assert sg("sglang:new_token_ratio") == pytest.approx(hy("hyssm_new_token_ratio"))
    steps, accepted = hy("hyssm_spec_verify_steps_total"), hy("hyssm_spec_accepted_tokens_total")
    assert steps > 0 and accepted > 0
    assert sg("sglang:spec_accept_length") == pytest.approx(1 + accepted / steps)
    assert sg("sglang:spec_accept_rate") == pytest.approx(accepted / hy("hyssm_spec_draft_tokens_total"))
    assert sg("sglang:gen_throughput") == 0.0  # one scrape: no rate yet


@pytest.mark.parametrize("hist", HISTOGRAMS)
def test_sglang_histograms_repeat_the_hyssm_buckets(info: SchedulerInfo, hist: str) -> None:
    s = _samples(_render(info.metrics))
    ours = {(n.removeprefix("hyssm_"), lab) for (n, lab) in s if n.startswith(f"hyssm_{hist}")}
    assert len(ours) > 3
    for name, lab in ours:
        assert s[(f"sglang:{name}", lab | {("model_name", MODEL)})] == s[(f"hyssm_{name}", lab)]
    assert s[(f"sglang:{hist}_count", frozenset({("model_name", MODEL)}))] > 0


def test_gen_throughput_is_the_rate_between_scrapes(info: SchedulerInfo) -> None:
    http = HttpMetrics()
    gen = next(r for r in info.metrics if r.name == "hyssm_generated_tokens_total")

    def throughput(extra: int, now: float) -> float:
        records = [r if r is not gen else MetricRecord(name=r.name, type=r.type, help=r.help, labels=r.labels,
                                                       value=r.value + extra) for r in info.metrics]  # fmt: skip
        return _get(_samples(_render(records, http, now)), "sglang:gen_throughput", model_name=MODEL)

    assert throughput(0, 100.0) == 0.0
    assert throughput(50, 102.0) == pytest.approx(25.0)
    assert throughput(150, 104.0) == pytest.approx(150 / 4)  # both earlier scrapes are within the window
    assert throughput(250, 120.0) == pytest.approx(100 / 16)  # the oldest kept is the one before the latest


def test_rate_window_restarts_when_the_counter_goes_down() -> None:
    w = RateWindow(window_s=10.0)
    assert w.observe(0.0, 100.0) == 0.0
    assert w.observe(5.0, 110.0) == pytest.approx(2.0)
    assert w.observe(6.0, 3.0) == 0.0  # a restarted scheduler
    assert w.observe(8.0, 7.0) == pytest.approx(2.0)
    assert len(w.samples) == 2


def test_without_scheduler_only_the_latency_series_remain() -> None:
    s = _samples(_render(None))
    names = {n for n, _ in s if n.startswith("sglang:")}
    assert names and all(any(h in n for h in HISTOGRAMS) for n in names)


# ---------------------------------------------------------------------------------- the dashboard

PROMQL_WORDS = {"sum", "avg", "min", "max", "count", "rate", "irate", "increase", "histogram_quantile", "by",
                "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "clamp_min",
                "clamp_max", "abs", "bool", "offset", "topk", "bottomk", "label_values", "le"}  # fmt: skip


def promql_names(expr: str) -> set[str]:
    """The series names a PromQL expression reads: identifiers that are not functions, keywords or
    label names (strings, label matchers, ranges and grouping lists removed first)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for m in re.finditer(r"(?<![\w:$.])[A-Za-z_:][\w:]*", e):
        if m.group() in PROMQL_WORDS or e[m.end():].lstrip().startswith("("):
            continue
        names.add(m.group())
    return names


def _queries(doc: object) -> Iterator[str]:
    """Every PromQL text of a dashboard: panel targets' `expr`, variables' `definition`."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            if k in ("expr", "definition") and isinstance(v, str):
                yield v
            else:
                yield from _queries(v)
    elif isinstance(doc, list):
        for v in doc:
            yield from _queries(v)


def test_promql_names_parser() -> None:
    expr = ('histogram_quantile(0.9, sum by (le, x) (rate(a_b_bucket{instance=~"$i",k="v{"}[$__rate_interval])))'
            ' / clamp_min(sum (c:d_total{q="1"}), 1e-9) + on(job) group_left e')
    assert promql_names(expr) == {"a_b_bucket", "c:d_total", "e"}
    assert promql_names("label_values(hyssm_scheduler_up, instance)") == {"hyssm_scheduler_up", "instance"}


def test_dashboard_reads_only_exported_names(info: SchedulerInfo) -> None:
    exported = {n for n, _ in _samples(_render(info.metrics))}
    doc = json.loads((ROOT / "dashboards" / "hyssm-grafana.json").read_text())
    assert doc["templating"]["list"][0]["type"] == "datasource"
    queries = list(_queries(doc))
    assert len(queries) > 20
    read = set().union(*(promql_names(q) for q in queries)) - {"instance"}  # label_values' label argument
    missing = sorted(n for n in read if n not in exported)
    assert not missing, f"the dashboard reads names /metrics does not export: {missing}"
    for base in ("hyssm_time_to_first_token_seconds", "hyssm_inter_token_latency_seconds"):
        assert f"{base}_bucket" in read  # quantiles come from the buckets
    panels = {p["title"] for p in doc["panels"]}
    assert {"Throughput (tokens/s)", "Queue and running batch", "Speculative acceptance"} <= panels


def test_dashboard_file_is_what_the_generator_writes() -> None:
    assert (ROOT / "dashboards" / "hyssm-grafana.json").read_text() == grafana_dashboard.render()


def test_readme_names_every_sglang_series() -> None:
    readme = (ROOT / "README.md").read_text()
    missing = [m.name for m in SGLANG_METRICS if m.name not in readme]
    assert not missing and "dashboards/hyssm-grafana.json" in readme, missing
