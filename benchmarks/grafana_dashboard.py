"""Write dashboards/hyssm-grafana.json, the Grafana dashboard of hyssm's own /metrics series:

    python benchmarks/grafana_dashboard.py            # (re)write the checked-in file
    python benchmarks/grafana_dashboard.py --check    # exit 1 if the file differs from what this writes

The dashboard reads the hyssm_* series through a Prometheus data-source variable (`datasource`) and
an `instance` variable (the scrape targets that export hyssm_scheduler_up): throughput, TTFT /
inter-token / TPOT / end-to-end quantiles from the histogram buckets, the waiting queue and running
batch, KV and state-slot use, prefix-cache hit rate, admission refusals, retries and deferrals by
reason, retractions, speculative acceptance, finished requests and HTTP statuses. Every query is
PromQL over names tests/tokenizer/test_sglang_metrics.py checks the server exports.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

OUT = Path(__file__).resolve().parents[1] / "dashboards" / "hyssm-grafana.json"
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'instance=~"$instance"'
RI = "[$__rate_interval]"

Target = tuple[str, str]  # (PromQL, legend)


def _rate(name: str, match: str = "", by: str = "") -> str:
    """sum [by (by)] (rate(name{instance, match}[$__rate_interval]))"""
    labels = ",".join(x for x in (SEL, match) if x)
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({name}{{{labels}}}{RI}))"


def _gauge(name: str, match: str = "", by: str = "") -> str:
    labels = ",".join(x for x in (SEL, match) if x)
    group = f" by ({by})" if by else ""
    return f"sum{group} ({name}{{{labels}}})"


def _quantiles(hist: str) -> list[Target]:
    buckets = f"sum by (le) (rate({hist}_bucket{{{SEL}}}{RI}))"
    out: list[Target] = [(f"histogram_quantile({q}, {buckets})", f"p{round(q * 100)}") for q in (0.5, 0.9, 0.99)]
    out.append((f"{_rate(hist + '_sum')} / {_rate(hist + '_count')}", "mean"))
    return out


def _ratio(num: str, den: str) -> str:
    return f"{num} / clamp_min({den}, 1e-9)"


def _slots(kind: str) -> list[Target]:
    return [
        (_gauge(f"hyssm_{kind}_slots", by="state"), "{{state}}"),
        (_gauge(f"hyssm_{kind}_slots_evictable"), "evictable (of cached)"),
        (_gauge(f"hyssm_{kind}_slots_capacity"), "capacity"),
    ]


def panels() -> list[tuple[str, str, list[Target]]]:
    """(title, unit, targets) of every panel, in display order (two per row)."""
    return [
        ("Throughput (tokens/s)", "short", [
            (_rate("hyssm_prefix_cache_queried_tokens_total"), "prompt tokens admitted"),
            (_rate("hyssm_prefill_tokens_total"), "prefill tokens computed"),
            (_rate("hyssm_generated_tokens_total"), "generated tokens"),
        ]),
        ("Time to first token", "s", _quantiles("hyssm_time_to_first_token_seconds")),
        ("Inter-token latency", "s", _quantiles("hyssm_inter_token_latency_seconds")),
        ("Time per output token", "s", _quantiles("hyssm_time_per_output_token_seconds")),
        ("End-to-end request latency", "s", _quantiles("hyssm_e2e_request_latency_seconds")),
        ("Queue time (arrival to admission)", "s", _quantiles("hyssm_queue_time_seconds")),
        ("Queue and running batch", "short", [
            (_gauge("hyssm_num_waiting_reqs"), "waiting"),
            (_gauge("hyssm_num_running_reqs"), "running"),
            (_gauge("hyssm_http_in_flight_requests"), "HTTP in flight"),
        ]),
        ("KV token slots", "short", _slots("kv")),
        ("State slots (Mamba / recurrent)", "short", _slots("mamba")),
        ("Prefix-cache hit rate", "percentunit", [
            (_ratio(_rate("hyssm_prefix_cache_hit_tokens_total", 'kind="state"'),
                    _rate("hyssm_prefix_cache_queried_tokens_total")), "resumed from a cached state"),
            (_ratio(_rate("hyssm_prefix_cache_hit_tokens_total"), _rate("hyssm_prefix_cache_queried_tokens_total")),
             "KV matched (state + kv_only)"),
        ]),
        ("Admission refusals, retries, deferrals (/s)", "short", [
            (_rate("hyssm_admission_refusals_total", by="reason"), "refused: {{reason}}"),
            (_rate("hyssm_admission_retries_total"), "retries"),
            (_rate("hyssm_admission_deferred_total", by="reason"), "deferred: {{reason}}"),
        ]),
        ("Retractions (/s)", "short", [(_rate("hyssm_retractions_total", by="cause"), "{{cause}}")]),
        ("Speculative acceptance", "short", [
            (_ratio(_rate("hyssm_spec_accepted_tokens_total"), _rate("hyssm_spec_draft_tokens_total")),
             "accepted / drafted"),
            ("1 + " + _ratio(_rate("hyssm_spec_accepted_tokens_total"), _rate("hyssm_spec_verify_steps_total")),
             "tokens per verify step"),
        ]),
        ("Requests finished (/s)", "reqps", [(_rate("hyssm_requests_finished_total", by="reason"), "{{reason}}")]),
        ("HTTP requests (/s)", "reqps", [
            (_rate("hyssm_http_requests_total", by="status"), "{{status}}"),
            (_gauge("hyssm_scheduler_up"), "schedulers up"),
        ]),
    ]


def _panel(pid: int, title: str, unit: str, targets: list[Target]) -> dict[str, Any]:
    return {
        "id": pid, "type": "timeseries", "title": title, "datasource": DS,
        "gridPos": {"h": 8, "w": 12, "x": 12 * ((pid - 1) % 2), "y": 8 * ((pid - 1) // 2)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "none"}},
        "targets": [{"refId": chr(ord("A") + i), "datasource": DS, "expr": expr, "legendFormat": legend,
                     "range": True} for i, (expr, legend) in enumerate(targets)],
    }  # fmt: skip


def dashboard() -> dict[str, Any]:
    """The whole dashboard document."""
    instance_query = "label_values(hyssm_scheduler_up, instance)"
    templating = [
        {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus", "current": {}},
        {"name": "instance", "label": "instance", "type": "query", "datasource": DS, "definition": instance_query,
         "query": {"query": instance_query, "refId": "instance"}, "refresh": 2, "includeAll": True, "multi": True,
         "allValue": ".*", "current": {"text": "All", "value": "$__all"}},
    ]  # fmt: skip
    return {
        "title": "hyssm", "uid": "hyssm", "tags": ["hyssm"], "editable": True, "schemaVersion": 39, "version": 1,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "10s", "timezone": "browser",
        "templating": {"list": templating},
        "panels": [_panel(i, *p) for i, p in enumerate(panels(), start=1)],
    }  # fmt: skip


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the checked-in file is not what this writes")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    text = render()
    if a.check:
        same = a.out.exists() and a.out.read_text() == text
        print(f"{a.out}: {'up to date' if same else 'differs; rerun without --check'}")
        return 0 if same else 1
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(text)
    print(f"wrote {a.out} ({len(dashboard()['panels'])} panels)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
