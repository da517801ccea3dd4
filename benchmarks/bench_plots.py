"""Figures of the benchmark tools (matplotlib, the optional ``bench`` extra: ``pip install -e .[bench]``).

- ``plot_sweep``: a load sweep of bench_serving (bench_sweep.py's JSON document): three panels
  against the load (concurrency or request rate): output tok/s, TTFT and ITL; one colour per target
  (system), TTFT and ITL drawn as p50 (solid, label ``<target> p50``) and p99 (dashed, ``<target> p99``),
  on a log scale when a panel's values span a factor of 10 or more.
- ``plot_peers``: bench_peers' medians: output tok/s against concurrency (one line per system) and
  the TTFT of each scenario, ms per decode token and peak RSS as bars grouped by system.
Both return the ``matplotlib.figure.Figure`` (no pyplot, so no global state and no display needed);
``save_figure`` writes it as PNG. Missing values (None/NaN) are left out of a line. As a script it
redraws a figure from the JSON a benchmark wrote:

    python -m benchmarks.bench_plots --peers peers.json -o peers.png   # bench_peers --output-json
    python -m benchmarks.bench_plots --sweep sweep.json -o sweep.png   # bench_serving --sweep-* --out-json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SWEEP_PANELS = (("output_token_throughput", "output tok/s"), ("ttft_ms", "TTFT (ms)"), ("itl_ms", "ITL (ms)"))
PERCENTILES = (("median", "p50", "-"), ("p99", "p99", "--"))
LOAD_LABELS = {"concurrency": "concurrency (requests in flight)", "rate": "request rate (req/s, Poisson)"}
PEER_TTFTS = (("ttft_cold_ms", "cold"), ("ttft_prefix_ms", "continuation"), ("ttft_shared_ms", "shared prefix"))


def _figure_class() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise RuntimeError("plotting needs matplotlib: pip install 'hyssm[bench]' (or pip install matplotlib)") from e
    return Figure


def _num(v: object) -> float | None:
    """v as a finite float, else None."""
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v)):
        return float(v)
    return None


def _points(xs: Sequence[float], ys: Sequence[object]) -> tuple[list[float], list[float]]:
    keep = [(x, y) for x, y in zip(xs, (_num(v) for v in ys), strict=True) if y is not None]
    return [x for x, _ in keep], [y for _, y in keep]


def _log_x_if_wide(ax: Any, xs: Sequence[float]) -> None:
    positive = [x for x in xs if x > 0]
    if positive and len(positive) == len(xs) and max(positive) / min(positive) >= 8:
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(set(positive)), [f"{x:g}" for x in sorted(set(positive))])


def _log_y_if_wide(ax: Any) -> None:
    """Log scale on a latency panel whose values span at least a factor of 10 (p99 far above p50)."""
    ys = [y for line in ax.get_lines() for y in line.get_ydata()]
    if ys and min(ys) > 0 and max(ys) / min(ys) >= 10:
        ax.set_yscale("log")


def plot_sweep(doc: Mapping[str, Any]) -> Any:
    """The sweep figure (module doc) of a bench_sweep JSON document."""
    fig = _figure_class()(figsize=(13, 4), layout="constrained")
    axes = fig.subplots(1, len(SWEEP_PANELS))
    xs_all: list[float] = []
    for i, target in enumerate(doc["targets"]):
        color = f"C{i % 10}"
        xs = [float(p["load"]) for p in target["points"]]
        xs_all.extend(xs)
        for ax, (key, _) in zip(axes, SWEEP_PANELS, strict=True):
            if key == "output_token_throughput":
                ax.plot(*_points(xs, [p[key] for p in target["points"]]), marker="o", color=color,
                        label=target["label"])  # fmt: skip
                continue
            for stat, name, style in PERCENTILES:
                ys = [(p.get(key) or {}).get(stat) for p in target["points"]]
                ax.plot(*_points(xs, ys), marker="o", linestyle=style, color=color, label=f"{target['label']} {name}")
    for ax, (key, title) in zip(axes, SWEEP_PANELS, strict=True):
        ax.set_title(title)
        ax.set_xlabel(LOAD_LABELS.get(doc["sweep"], doc["sweep"]))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
        _log_x_if_wide(ax, xs_all)
        if key != "output_token_throughput":
            _log_y_if_wide(ax)
    fig.suptitle(doc.get("title") or f"load sweep: {doc['sweep']}")
    return fig


def peer_levels(medians: Mapping[str, Mapping[str, float | None]]) -> list[int]:
    """The concurrency levels that have a ``tps_c<N>`` figure in any system, ascending."""
    found = {int(m.group(1)) for r in medians.values() for k in r if (m := re.fullmatch(r"tps_c(\d+)", k))}
    return sorted(found)


def _bars(ax: Any, systems: Sequence[str], groups: Sequence[tuple[str, str]],
          medians: Mapping[str, Mapping[str, float | None]]) -> None:  # fmt: skip
    """Grouped bars: one group per (key, label), one bar per system (missing values: no bar)."""
    width = 0.8 / max(len(systems), 1)
    for i, system in enumerate(systems):
        xs = [g + (i - (len(systems) - 1) / 2) * width for g in range(len(groups))]
        ys = [_num(medians[system].get(key)) for key, _ in groups]
        kept = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
        ax.bar([x for x, _ in kept], [y for _, y in kept], width=width, color=f"C{i % 10}", label=system)
    ax.set_xticks(range(len(groups)), [label for _, label in groups])
    ax.grid(True, axis="y", alpha=0.3)


def plot_peers(medians: Mapping[str, Mapping[str, float | None]], title: str = "bench_peers") -> Any:
    """The peers figure (module doc) of bench_peers' medians {system: {metric key: value}}."""
    fig = _figure_class()(figsize=(16, 4), layout="constrained")
    ax_tps, ax_ttft, ax_decode, ax_rss = fig.subplots(1, 4)
    systems = list(medians)
    levels = peer_levels(medians)
    for i, system in enumerate(systems):
        ys = [medians[system].get(f"tps_c{c}") for c in levels]
        ax_tps.plot(*_points([float(c) for c in levels], ys), marker="o", color=f"C{i % 10}", label=system)
    ax_tps.set(title="output tok/s", xlabel="concurrency")
    ax_tps.grid(True, alpha=0.3)
    _log_x_if_wide(ax_tps, [float(c) for c in levels])
    _bars(ax_ttft, systems, PEER_TTFTS, medians)
    ax_ttft.set(title="TTFT (ms)")
    _bars(ax_decode, systems, (("decode_ms", "concurrency 1"),), medians)
    ax_decode.set(title="ms per decode token")
    _bars(ax_rss, systems, (("peak_rss_mib", "process tree"),), medians)
    ax_rss.set(title="peak RSS (MiB)")
    for ax in (ax_tps, ax_ttft, ax_decode, ax_rss):
        ax.legend(fontsize="small")
    fig.suptitle(title)
    return fig


def save_figure(fig: Any, path: str | Path, dpi: int = 80) -> None:
    """Write the figure as PNG (creating the parent directory)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=dpi)
    logger.info("wrote %s", path)


def main(argv: Sequence[str] | None = None) -> int:
    """Redraw a bench_peers or sweep figure from its JSON (see the module docstring)."""
    p = argparse.ArgumentParser(description="Redraw a benchmark figure (PNG) from the JSON the benchmark wrote.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--peers", metavar="JSON", help="bench_peers --output-json: its medians")
    src.add_argument("--sweep", metavar="JSON", help="a load sweep's document (bench_serving --sweep-*)")
    p.add_argument("-o", "--output", required=True, metavar="PNG")
    p.add_argument("--title", default=None, help="bench_peers figure title")
    args = p.parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:
        p.error("needs matplotlib: pip install 'hyssm[bench]' (or pip install matplotlib)")
    with open(args.peers or args.sweep, encoding="utf-8") as f:
        doc = json.load(f)
    if args.peers:
        fig = plot_peers(doc["medians"], **({"title": args.title} if args.title else {}))
    else:
        fig = plot_sweep(doc)
    save_figure(fig, args.output)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
