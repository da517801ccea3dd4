"""bench_state_cache's figures: medians of the raw records, ratios and the markdown tables (pure).

Raw records (bench_state_cache.run): ``ttft[length][scenario]`` = one dict per repeat (``ttft_s``,
``cached_tokens`` and the growth of state_cache_servers.COUNTERS around the request); ``working_set`` = the
pools and per server (``no_store``, ``store``) the ws_totals of its measured rounds; ``drain[server]`` = one
dict per repeat (serving_metrics ITL percentiles by window, ``prefill_s``). A ratio is store / no store (or
scenario / cold); a missing or zero denominator gives NaN, printed "-".
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

from benchmarks.serving_metrics import percentile

SCENARIOS = ("cold", "memory", "store_same_server", "store_after_restart", "store_other_replica")
LABELS = {
    "cold": "cold (memory flushed, nothing stored)",
    "memory": "memory hit (same prompt again)",
    "store_same_server": "store hit, same server (memory flushed)",
    "store_after_restart": "store hit after a restart",
    "store_other_replica": "store hit, other server on the folder",
}
DRAIN_WINDOWS = (("all", "whole stream"), ("contended", "after the long prompt was sent"),
                 ("drain", "after it was answered"), ("writing", "while its entries were written"),
                 ("written", "after its entries were on disk"))  # fmt: skip


def median(values: Sequence[float]) -> float:
    finite = [float(v) for v in values if not math.isnan(float(v))]
    return statistics.median(finite) if finite else math.nan


def ratio(num: float, den: float) -> float:
    return num / den if den and not math.isnan(den) else math.nan


def _fmt(v: object, digits: int = 1) -> str:
    if not isinstance(v, (int, float)) or math.isnan(v):
        return "-"
    return f"{v:.{digits}f}" if abs(v) < 1000 else f"{v:.0f}"


def itl_windows(chunks: Sequence[tuple[float, int]], sent: float, answered: float,
                stored: float | None = None) -> dict[str, float]:  # fmt: skip
    """Token count, p50 and p99 (ms) of the inter-token latencies (serving_metrics.itls_from_chunks) of every
    gap ("all"), of the gaps ending after `sent` ("contended"), of those starting after `answered` ("drain"),
    of those between `answered` and `stored` (the writer draining: "writing") and of those after ("written")."""
    stored = answered if stored is None else stored
    marks = [(t, n) for t, n in chunks if n > 0]
    gaps = [(t0, t1, (t1 - t0) / n1) for (t0, _), (t1, n1) in zip(marks, marks[1:], strict=False) for _ in range(n1)]
    windows = {"all": gaps, "contended": [g for g in gaps if g[1] > sent],
               "drain": [g for g in gaps if g[0] >= answered],
               "writing": [g for g in gaps if g[0] >= answered and g[1] <= stored],
               "written": [g for g in gaps if g[0] >= stored]}  # fmt: skip
    out = {f"{w}_tokens": float(len(v)) for w, v in windows.items()}
    for w, v in windows.items():
        ms = [g[2] * 1000.0 for g in v]
        out[f"{w}_p50_ms"], out[f"{w}_p99_ms"] = percentile(ms, 50), percentile(ms, 99)
    return out


def summarize_ttft(ttft: Mapping[int, Mapping[str, Sequence[Mapping[str, float]]]]) -> dict[int, dict[str, dict]]:
    """Per length and scenario: median TTFT ms, every run's ms, x cold, median cached tokens, store loads."""
    out: dict[int, dict[str, dict]] = {}
    for length, rows in ttft.items():
        cold = median([r["ttft_s"] * 1000.0 for r in rows["cold"]])
        out[length] = {}
        for scenario in SCENARIOS:
            runs = rows[scenario]
            ms = median([r["ttft_s"] * 1000.0 for r in runs])
            out[length][scenario] = {
                "ttft_ms": ms, "runs_ms": [r["ttft_s"] * 1000.0 for r in runs], "vs_cold": ratio(ms, cold),
                "cached_tokens": median([r["cached_tokens"] for r in runs]),
                "loads_loaded": sum(r["loads_loaded"] for r in runs),
                "loads_started": sum(r["loads_started"] for r in runs),
                "store_hit_tokens": sum(r["store_hit_tokens"] for r in runs),
                "memory_hit_tokens": sum(r["memory_hit_tokens"] for r in runs),
            }  # fmt: skip
    return out


def ws_totals(rounds: list[dict[str, float]]) -> dict[str, float]:
    """The rounds' sums, rates and shares of the queried tokens served by each tier."""
    t = {k: sum(r[k] for r in rounds) for k in rounds[0]}
    queried = t["queried_tokens"] or float("nan")
    return {**t, "requests_per_s": t["requests"] / t["seconds"],
            "prompt_tokens_per_s": t["prompt_tokens"] / t["seconds"],
            "cached_share": t["cached_tokens"] / t["prompt_tokens"],
            "cache_share": (t["memory_hit_tokens"] + t["store_hit_tokens"]) / queried,
            "memory_share": t["memory_hit_tokens"] / queried, "store_share": t["store_hit_tokens"] / queried,
            "rounds_s": [r["seconds"] for r in rounds]}  # fmt: skip


def summarize_drain(drain: Mapping[str, Sequence[Mapping[str, float]]]) -> dict[str, dict[str, float]]:
    """Per server the median of every field over the repeats; "ratio": store / no store of each."""
    out = {label: {k: median([r[k] for r in runs]) for k in runs[0]} for label, runs in drain.items() if runs}
    if "store" in out and "no_store" in out:
        out["ratio"] = {k: ratio(out["store"][k], out["no_store"][k]) for k in out["store"]}
    if "store" in out:  # the writer's cost within one server: while it writes against after
        st = out["store"]
        out["writer_cost"] = {q: ratio(st[f"writing_{q}_ms"], st[f"written_{q}_ms"]) for q in ("p50", "p99")}
    return out


def summarize(doc: Mapping[str, object]) -> dict[str, object]:
    out: dict[str, object] = {}
    if "ttft" in doc:
        out["ttft"] = summarize_ttft(doc["ttft"])  # type: ignore[arg-type]
    ws = doc.get("working_set")
    if isinstance(ws, dict):
        keys = ("requests_per_s", "prompt_tokens_per_s", "cache_share", "store_share")
        out["working_set_ratio"] = {k: ratio(ws["store"][k], ws["no_store"][k]) for k in keys}
    if "drain" in doc:
        out["drain"] = summarize_drain(doc["drain"])  # type: ignore[arg-type]
    return out


def ttft_table(summary: Mapping[int, Mapping[str, Mapping]]) -> list[str]:
    lines = ["| prompt tokens | scenario | TTFT ms (median) | runs (ms) | x cold | cached tokens | store loads |",
             "|---:|---|---:|---|---:|---:|---:|"]  # fmt: skip
    for length, rows in summary.items():
        for scenario in SCENARIOS:
            r = rows[scenario]
            runs = ", ".join(_fmt(v, 0) for v in r["runs_ms"])
            loads = f"{r['loads_loaded']:.0f}/{r['loads_started']:.0f}"
            lines.append(f"| {length} | {LABELS[scenario]} | {_fmt(r['ttft_ms'])} | {runs} | {_fmt(r['vs_cold'], 3)} "
                         f"| {_fmt(r['cached_tokens'], 0)} | {loads} |")  # fmt: skip
    return lines


def working_set_table(ws: Mapping[str, object], ratios: Mapping[str, float]) -> list[str]:
    lines = [f"pools {ws['pools']}: working set {ws['working_set_tokens']} tokens = {_fmt(ws['kv_ratio'], 2)} x the "
             f"KV pool, {_fmt(ws['state_ratio'], 2)} x the state pool", "",
             "| server | requests | req/s | prompt tok/s | from a cache tier | memory | store | store loads |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for label in ("no_store", "store"):
        r = ws[label]
        assert isinstance(r, dict)
        lines.append(f"| {label.replace('_', ' ')} | {r['requests']} | {_fmt(r['requests_per_s'], 3)} "
                     f"| {_fmt(r['prompt_tokens_per_s'])} | {_fmt(100 * r['cache_share'])}% "
                     f"| {_fmt(100 * r['memory_share'])}% | {_fmt(100 * r['store_share'])}% "
                     f"| {r['loads_loaded']:.0f}/{r['loads_started']:.0f} |")  # fmt: skip
    lines.append(f"| store / no store | | {_fmt(ratios['requests_per_s'], 2)} "
                 f"| {_fmt(ratios['prompt_tokens_per_s'], 2)} | | | | |")  # fmt: skip
    return lines


def drain_table(summary: Mapping[str, Mapping[str, float]]) -> list[str]:
    lines = ["| server | window | ITL tokens | ITL p50 ms | ITL p99 ms | long prefill s | its writes s |",
             "|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for label in ("no_store", "store", "ratio"):
        r = summary.get(label)
        if r is None:
            continue
        name = "store / no store" if label == "ratio" else label.replace("_", " ")
        for w, text in DRAIN_WINDOWS:
            tokens = "" if label == "ratio" else _fmt(r[f"{w}_tokens"], 0)
            digits = 3 if label == "ratio" else 1
            lines.append(f"| {name} | {text} | {tokens} | {_fmt(r[f'{w}_p50_ms'], digits)} "
                         f"| {_fmt(r[f'{w}_p99_ms'], digits)} | {_fmt(r['prefill_s'], 2)} "
                         f"| {_fmt(r.get('write_s', math.nan), 2)} |")  # fmt: skip
    cost = summary.get("writer_cost")
    if cost is not None:
        lines += ["", f"The writer's cost within the store server (ITL while its entries were written / after): "
                      f"p50 {_fmt(cost['p50'], 3)}, p99 {_fmt(cost['p99'], 3)}"]
    return lines


def format_report(doc: Mapping[str, object]) -> str:
    cfg = doc["config"]
    assert isinstance(cfg, dict)
    summary = doc["summary"]
    assert isinstance(summary, dict)
    out = [f"## State store: {cfg['shape']} ({cfg['dtype']}, device {cfg['device']}), blocks of "
           f"{cfg['block_tokens']} tokens, write_through; {cfg['repeats']} fresh prompts per row, medians; "
           f"{_fmt(doc['elapsed_s'], 0)} s in all", ""]  # fmt: skip
    if "ttft" in summary:
        out += ["### TTFT (max_new_tokens=1)", "", *ttft_table(summary["ttft"]), ""]
    if "working_set" in doc:
        ws = doc["working_set"]
        assert isinstance(ws, dict)
        out += [f"### Working set: {cfg['ws_prefixes']} prefixes x {cfg['ws_len']} tokens + {cfg['ws_suffix']}-token "
                f"suffixes, round-robin, {cfg['ws_rounds']} rounds after a fill round, one request at a time", "",
                *working_set_table(ws, summary["working_set_ratio"]), ""]  # fmt: skip
    if "drain" in summary:
        out += [f"### Decode while the writer drains: {cfg['decode_tokens']} streamed tokens beside a "
                f"{cfg['drain_len'] or max(cfg['lengths'])}-token prefill", "", *drain_table(summary["drain"]), ""]
    return "\n".join(out)
