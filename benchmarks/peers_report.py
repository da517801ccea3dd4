"""bench_peers' figures: the metric list, medians over runs, ratios and the printed table (pure).

A system's result is {metric key: value or None}; None (not measured, or the
system skipped) prints as "-" and gives no ratio. Ratios are hyssm / peer for every metric; the
row label says which way is better (tok/s: higher, ms and MiB: lower), so for tok/s a ratio > 1
means hyssm is ahead and for latencies and memory a ratio < 1 does. The weights' dtype, the same in
every system, is a line of the table and a top-level key of the JSON; so is each server's configuration
(``configs``: {system: one line}: its flags and memory pools, e.g. hyssm's KV and state pools and
llama-server's --parallel / -c and how that context was sized), one ``config:`` line each, since a peak
RSS means little without the pools behind it.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    higher_is_better: bool


METRICS: tuple[Metric, ...] = (
    Metric("tps_c1", "out tok/s, concurrency 1 (tf: batch 1)", True),
    Metric("tps_c8", "out tok/s, concurrency 8 (tf: static batch 8)", True),
    Metric("tps_c32", "out tok/s, concurrency 32 (tf: static batch 32)", True),
    Metric("ttft_cold_ms", "TTFT ms, cold prompt", False),
    Metric("ttft_prefix_ms", "TTFT ms, continuation of a cached prompt (tf: whole prompt)", False),
    Metric("ttft_shared_ms", "TTFT ms, shared prefix + new suffix, third request (tf: whole prompt)", False),
    Metric("decode_ms", "ms per decode token, concurrency 1", False),
    Metric("peak_rss_mib", "peak RSS MiB (process tree)", False),
)
SYSTEMS = ("hyssm", "llama.cpp", "transformers")
PEERS = ("llama.cpp", "transformers")


def median_runs(runs: Sequence[Mapping[str, float | None]]) -> dict[str, float | None]:
    """Per-metric median over runs, ignoring missing/None/NaN values (None when no run has one)."""
    out: dict[str, float | None] = {}
    for m in METRICS:
        vals = [float(v) for r in runs if (v := r.get(m.key)) is not None and not math.isnan(float(v))]
        out[m.key] = statistics.median(vals) if vals else None
    return out


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """ours / theirs, None when either is missing or theirs is 0."""
    if ours is None or theirs is None or theirs == 0:
        return None
    return ours / theirs


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if abs(v) >= 100:
        return f"{v:.0f}"
    return f"{v:.2f}" if abs(v) >= 1 else f"{v:.3f}"


def _ratio_cell(r: float | None, higher_is_better: bool) -> str:
    if r is None:
        return "-"
    ahead = r > 1 if higher_is_better else r < 1
    return f"{r:.2f}x" + (" +" if ahead else "")


def build_rows(results: Mapping[str, Mapping[str, float | None]]) -> list[list[str]]:
    """Table rows: label (with which way is better), one value per system, one ratio per peer."""
    rows = []
    for m in METRICS:
        vals = [results.get(s, {}).get(m.key) for s in SYSTEMS]
        ours = vals[0]
        direction = "higher is better" if m.higher_is_better else "lower is better"
        ratios = [_ratio_cell(ratio(ours, results.get(p, {}).get(m.key)), m.higher_is_better) for p in PEERS]
        rows.append([f"{m.label} [{direction}]", *(_fmt(v) for v in vals), *ratios])
    return rows


def format_table(
    results: Mapping[str, Mapping[str, float | None]],
    notes: Sequence[str] = (),
    dtype: str | None = None,
    configs: Mapping[str, str] | None = None,
) -> str:
    """A Markdown table of the median figures with ratio columns; the dtype line (when given), one
    ``config:`` line per system configuration (in SYSTEMS order) and the notes (e.g. skip messages)
    below, the notes last."""
    header = ["metric", *SYSTEMS, *(f"hyssm/{p}" for p in PEERS)]
    rows = [header, *build_rows(results)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return (
            "| "
            + " | ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
            )
            + " |"
        )

    out = [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *(line(r) for r in rows[1:])]
    out.append("ratios are hyssm/peer; '+' marks where hyssm is ahead (tok/s ratio > 1, ms/MiB ratio < 1)")
    if dtype is not None:
        out.append(f"weights: {dtype} (hyssm --dtype / --quantization, llama.cpp's GGUF type, transformers' dtype)")
    configs = configs or {}
    out.extend(f"config: {configs[s]}" for s in sorted(configs, key=_system_order))
    out.extend(f"note: {n}" for n in notes)
    return "\n".join(out)


def _system_order(name: str) -> tuple[int, str]:
    return (SYSTEMS.index(name) if name in SYSTEMS else len(SYSTEMS), name)


def to_json(
    results: Mapping[str, Mapping[str, float | None]],
    runs: Mapping[str, Sequence[Mapping[str, object]]],
    notes: Sequence[str],
    config: Mapping[str, object],
    dtype: str | None = None,
    configs: Mapping[str, str] | None = None,
) -> str:
    """Strict JSON of the dtype, the medians, the ratios, every run, the notes, the invocation's config
    and each system's configuration line (``configs``)."""
    ratios = {
        f"hyssm/{p}": {
            m.key: ratio(results.get("hyssm", {}).get(m.key), results.get(p, {}).get(m.key)) for m in METRICS
        }
        for p in PEERS
    }
    doc = {"dtype": dtype, "medians": results, "ratios": ratios, "runs": runs, "notes": list(notes), "config": config,
           "configs": dict(configs or {})}  # fmt: skip
    return json.dumps(doc, indent=2, allow_nan=False)
