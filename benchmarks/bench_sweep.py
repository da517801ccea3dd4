"""Load sweeps of bench_serving: the same workload at several loads, against one or more targets.

    python benchmarks/bench_serving.py --sweep-concurrency 1,2,4,8,16,32 --num-prompts 64 --plot sweep.png
    python benchmarks/bench_serving.py --sweep-rate 1,2,4,8 --num-prompts 64 \
        --target hyssm=hyssm@http://127.0.0.1:30000 --target llama.cpp=llama-server@http://127.0.0.1:8080 \
        --plot peers-sweep.png --out-json peers-sweep.json

A load level is one bench_serving benchmark (``--num-prompts`` requests, every other flag as given) with
``--concurrency`` set to the level (``--sweep-concurrency``) or ``--request-rate`` set to it
(``--sweep-rate``, open loop; ``--concurrency`` still caps the requests in flight when given). The
targets are ``--target LABEL=BACKEND@URL`` (repeatable; each its own line on the figure), else the one
server of ``--backend`` / ``--base-url``. Levels run in the order given, target after target.

Output: one summary line per (target, level); the JSON document (``--out-json``, else ``--output-json``,
else the plot's path with ``.json``) {"sweep": "concurrency"|"rate", "levels", "targets": [{"label", "backend",
"base_url", "points": [{"load", ...bench_serving's metrics of that level}]}], "config"}, from which
bench_plots.plot_sweep draws ``--plot`` (so a figure can be redrawn from its JSON). As a script it reads
such a document back: one summary line per (target, level), and the figure again with ``--plot``:

    python -m benchmarks.bench_sweep sweep.json [--plot sweep.png]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
import math
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.serving_backends import canonical_backend
from benchmarks.serving_metrics import json_safe

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Target:
    """One system of a sweep: its line label, bench_serving backend and base URL."""

    label: str
    backend: str
    base_url: str


@dataclass(frozen=True)
class SweepOptions:
    """What a sweep varies (``kind``: "concurrency" or "rate"), over which levels, against which
    targets (empty: the configured server), and where its figure and JSON go."""

    kind: str
    levels: tuple[float, ...]
    targets: tuple[Target, ...] = ()
    plot: str | None = None
    out_json: str | None = None


SWEEP_DESTS = ("sweep_concurrency", "sweep_rate", "target", "plot", "out_json")


def add_sweep_flags(p: argparse.ArgumentParser) -> None:
    """The sweep flags of bench_serving's CLI (their dests are SWEEP_DESTS)."""
    a = p.add_argument
    a("--sweep-concurrency", default=None, metavar="C1,C2,...", help="run once per concurrency level")
    a("--sweep-rate", default=None, metavar="R1,R2,...", help="run once per Poisson request rate (req/s)")
    a("--target", action="append", default=[], metavar="LABEL=BACKEND@URL",
      help="a system to sweep (repeatable), e.g. llama.cpp=llama-server@http://127.0.0.1:8080")  # fmt: skip
    a("--plot", default=None, metavar="PNG", help="sweep figure (needs matplotlib: pip install 'hyssm[bench]')")
    a("--out-json", default=None, metavar="PATH", help="sweep data (default: the --plot path with .json)")


def parse_target(text: str) -> Target:
    """``LABEL=BACKEND@URL`` -> Target; raises ValueError when malformed or the backend is unknown."""
    label, sep, rest = text.partition("=")
    backend, sep2, url = rest.partition("@")
    if not (sep and sep2 and label and backend and url):
        raise ValueError(f"--target must be LABEL=BACKEND@URL, got {text!r}")
    return Target(label, canonical_backend(backend), url.rstrip("/"))


def parse_levels(text: str, kind: str) -> tuple[float, ...]:
    """Comma-separated positive levels (integers for concurrency); raises ValueError."""
    try:
        levels = tuple(int(x) if kind == "concurrency" else float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--sweep-{kind} must be comma-separated {'integers' if kind == 'concurrency' else 'numbers'}"
                         f", got {text!r}") from None  # fmt: skip
    if not levels or any(not (x > 0) or math.isinf(x) for x in levels):
        raise ValueError(f"--sweep-{kind} levels must be positive and finite, got {text!r}")
    return levels


def sweep_options(ns: argparse.Namespace) -> SweepOptions | None:
    """The SweepOptions of parsed flags (None when no sweep was asked for); raises ValueError."""
    if ns.sweep_concurrency and ns.sweep_rate:
        raise ValueError("give --sweep-concurrency or --sweep-rate, not both")
    text = ns.sweep_concurrency or ns.sweep_rate
    if not text:
        if ns.target or ns.plot or ns.out_json:
            raise ValueError("--target, --plot and --out-json need --sweep-concurrency or --sweep-rate")
        return None
    kind = "concurrency" if ns.sweep_concurrency else "rate"
    out_json = ns.out_json or ns.output_json or (str(Path(ns.plot).with_suffix(".json")) if ns.plot else None)
    return SweepOptions(kind, parse_levels(text, kind), tuple(parse_target(t) for t in ns.target), ns.plot, out_json)


Bench = Callable[[Any], Awaitable[dict[str, object]]]


async def run_sweep(cfg: Any, opts: SweepOptions, bench: Bench) -> dict[str, object]:
    """Every (target, level) through `bench` (bench_serving.benchmark); the sweep document."""
    targets = opts.targets or (Target(cfg.backend, cfg.backend, cfg.base_url),)
    out = []
    for t in targets:
        points = []
        for level in opts.levels:
            load = {"concurrency": int(level)} if opts.kind == "concurrency" else {"request_rate": float(level)}
            one = dataclasses.replace(cfg, base_url=t.base_url, backend=t.backend, output_json=None, sweep=None, **load)
            logger.info("sweep %s: %s=%g", t.label, opts.kind, level)
            metrics = await bench(one)
            metrics.pop("config", None)
            points.append({"load": level, **metrics})
        out.append({"label": t.label, "backend": t.backend, "base_url": t.base_url, "points": points})
    config = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("sweep", "api_key", "output_json")}
    return {"sweep": opts.kind, "levels": list(opts.levels), "targets": out, "config": config}


def summary_lines(doc: dict[str, Any]) -> list[str]:
    """One line per (target, level): throughput, TTFT and ITL p50/p99, failures."""
    w = max(8, *(len(t["label"]) + 2 for t in doc["targets"]))
    lines = [f"{'target':<{w}}{doc['sweep']:>12}{'out tok/s':>11}{'TTFT p50':>10}{'p99':>9}{'ITL p50':>9}"
             f"{'p99':>9}{'failed':>8}"]  # fmt: skip
    for t in doc["targets"]:
        for p in t["points"]:
            lines.append(f"{t['label']:<{w}}{p['load']:>12g}{p['output_token_throughput']:>11.1f}"
                         f"{p['ttft_ms']['median']:>10.1f}{p['ttft_ms']['p99']:>9.1f}{p['itl_ms']['median']:>9.2f}"
                         f"{p['itl_ms']['p99']:>9.2f}{p['failed']:>8}")  # fmt: skip
    return lines


def write_outputs(doc: dict[str, Any], opts: SweepOptions) -> Any:
    """Write the JSON (strict: NaN -> null) and the figure; returns the figure (None without --plot)."""
    if opts.out_json:
        Path(opts.out_json).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.out_json).write_text(json.dumps(json_safe(doc), indent=2, allow_nan=False))
    if not opts.plot:
        return None
    from benchmarks.bench_plots import plot_sweep, save_figure

    fig = plot_sweep(doc)
    save_figure(fig, opts.plot)
    return fig


def some_level_failed(doc: dict[str, Any]) -> bool:
    """Whether some (target, level) completed no request."""
    return any(not p["completed"] for t in doc["targets"] for p in t["points"])


def check_plotting(opts: SweepOptions) -> None:
    """Fail before any load is sent when --plot is asked for without matplotlib."""
    if opts.plot and importlib.util.find_spec("matplotlib") is None:
        raise SystemExit("--plot needs matplotlib: pip install 'hyssm[bench]' (or pip install matplotlib)")


def main(argv: Sequence[str] | None = None) -> int:
    """Summarise (and redraw) a sweep from its JSON document; exit 1 when some level completed nothing."""
    p = argparse.ArgumentParser(description="Summarise a load sweep's JSON document (run one with bench_serving.py "
                                            "--sweep-concurrency or --sweep-rate).")  # fmt: skip
    p.add_argument("json", metavar="SWEEP_JSON")
    p.add_argument("--plot", default=None, metavar="PNG", help="redraw its figure (needs matplotlib)")
    args = p.parse_args(argv)
    with open(args.json, encoding="utf-8") as f:
        doc = json.load(f)
    opts = SweepOptions(doc["sweep"], tuple(doc["levels"]), plot=args.plot)
    check_plotting(opts)
    print("\n".join(summary_lines(doc)))
    write_outputs(doc, opts)
    return 1 if some_level_failed(doc) else 0


if __name__ == "__main__":
    sys.exit(main())
