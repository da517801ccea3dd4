"""Which matrix-product methods the CPU execution plan ever picks: a survey to retire the rest.

    python benchmarks/plan_survey.py [--families granite-4.0-h-350m,granite-4.0-h-tiny,nemotron-h,qwen3-next]
        [--dtypes float32,bfloat16] [--quantizations none,int8,int4,fp8] [--rounds 3] [--attempts 3]
        [--out-json benchmarks/results/plan_survey.json] [--out-text FILE] [--tiny] [--merge A.json,B.json]

For every family (one layer of each kind at the family's real widths: benchmarks/plan_survey_models.py), dtype
and `--quantization`, the model is built as a worker rank builds it and its plan is measured the way the worker
measures it (`choose` over a `ProductTimer`, as worker_proc.plan.source.measure_plan runs them, on torch's
thread count, never cached): every candidate kernel (THROUGHPUT_KERNELS) that serves a product shape is timed
at each row bucket (ROW_BUCKETS) for `--rounds` rounds (the plan's MEASURE_ROUNDS; a later round times only
the contenders, as the plan does). A configuration measured while other processes kept the CPU busy is
measured again (`--attempts`; each figure the fastest of all). A cell is one (family, dtype, quantization,
shape, bucket) the plan timed (an LM head is not timed past 64 rows, the few-row kernels not past their
`max_rows`); per cell the report gives every method's seconds per product, the fastest (`winner`) and the
method the plan binds there (`plan`: `dense` unless another is more than 3 % faster, a bucket keeping its
predecessor's method within 5 %, copies of weights only where affordable). The summary counts, per method,
the cells it was timed in, wins, is within 3 % of the winner in, and the plan picks it in; it lists the
methods that win nowhere and those some other method is everywhere within 3 % of (that method timed wherever
it is, and never more than 3 % slower: it could take its place).

The worker's API used (update these imports if its modules move): worker_proc.plan.execution_plan (`choose`
with its `rounds`, `ExecutionPlan`, `product_sites`), worker_proc.plan.tuning (MEASURE_ROUNDS,
PLAN_REPS, CONTENDED_CORES, MARGIN, ROW_BUCKETS), worker_proc.plan.product_timer (`ProductTimer`, `GemmKey`,
`Instance`, `Measure`), worker_proc.plan.method_choice.copy_affordable, worker_proc.plan.source
(`cpu_busy_seconds`, `cpu_identity`), worker_proc.linear.formats.THROUGHPUT_KERNELS,
worker_proc.linear.kernels.GemmKernel, worker_proc.host.memory (`bound_onednn_caches`,
`last_level_cache_bytes`, `map_load_blocks`, `keep_freed_memory`), worker_proc.host.numerics.flush_denormals; and in
plan_survey_models: worker_proc.loading.checkpoint.load_model, worker_proc.host.numerics.flush_subnormal_,
worker_proc.loading.quantize (`QuantScheme`, `quantize_model`), worker_proc.linear.site.GemmSite,
worker_proc.model.HybridForCausalLM, shared.families.registry.parse_config.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.plan_survey_models import FAMILIES, family_config, load_survey_model, survey_instances, write_checkpoint
from worker_proc.host.memory import bound_onednn_caches, keep_freed_memory, last_level_cache_bytes, map_load_blocks
from worker_proc.host.numerics import flush_denormals
from worker_proc.linear.formats import THROUGHPUT_KERNELS
from worker_proc.linear.kernels import GemmKernel
from worker_proc.plan import execution_plan
from worker_proc.plan.execution_plan import ExecutionPlan, choose
from worker_proc.plan.method_choice import copy_affordable
from worker_proc.plan.product_timer import GemmKey, Instance, Measure, ProductTimer
from worker_proc.plan.source import cpu_busy_seconds, cpu_identity
from worker_proc.plan.tuning import CONTENDED_CORES, MARGIN, MEASURE_ROUNDS, PLAN_REPS, ROW_BUCKETS

logger = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16")
QUANTIZATIONS = ("none", "int8", "int4", "fp8")
"""`none` and the values of `--quantization` (shared.config); all run on the CPU."""
NEAR = MARGIN
"""Within this fraction of the winner counts as a tie (the plan's MARGIN, 3 %)."""
CLEAR = 0.10
"""A win is clear when the next fastest method is more than this much slower (beyond a burst's noise)."""
Cell = dict[str, object]
COLUMNS = ("timed", "wins", "clear", "sole", "near", "plan", "dropped")
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "plan_survey.json"


class Recorder:
    """A `Measure` that passes the timer's figures on and keeps every one: (key, rows) -> method -> seconds
    of each round it was timed in."""

    def __init__(self, timer: Measure) -> None:
        self.timer = timer
        self.seen: dict[tuple[GemmKey, int], dict[str, list[float]]] = {}

    def __call__(self, method: GemmKernel, rows: int, threads: int) -> dict[GemmKey, float]:
        out = self.timer(method, rows, threads)
        for key, seconds in out.items():
            self.seen.setdefault((key, rows), {}).setdefault(method.name, []).append(seconds)
        return out


def measure(instances: list[Instance], rounds: int) -> tuple[ExecutionPlan, Recorder]:
    """worker_proc.plan.source.measure_plan's timing of these sites on torch's thread count (no recurrent kernels: one
    thread option), every figure recorded, under the steps' allocator policy as a worker's (the next load's
    policy after it)."""
    keep_freed_memory()
    timer = ProductTimer(instances, last_level_cache_bytes(), reps=PLAN_REPS)
    recorder = Recorder(timer)
    try:
        plan = choose(instances, (torch.get_num_threads(),), recorder, copy_affordable, None, rounds=rounds)
    finally:
        timer.release()
        map_load_blocks()
    return plan, recorder


def others_load(seconds: float) -> float:
    """Cores other processes kept busy on average over the next `seconds` (worker_proc.plan.source.cpu_busy_seconds)."""
    busy0, own0 = cpu_busy_seconds()
    t0 = time.perf_counter()
    time.sleep(seconds)
    busy1, own1 = cpu_busy_seconds()
    return max(0.0, (busy1 - busy0) - (own1 - own0)) / max(time.perf_counter() - t0, 1e-9)


def wait_quiet(max_wait_s: float) -> float:
    """Wait (at most `max_wait_s`) until other processes keep under CONTENDED_CORES busy; the seconds waited."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < max_wait_s and others_load(2.0) > CONTENDED_CORES:
        pass
    return time.perf_counter() - t0


def measured_quietly(instances: list[Instance], rounds: int, attempts: int,
                     max_wait_s: float) -> tuple[ExecutionPlan, Recorder, float, list[float]]:
    """`measure` after `wait_quiet`, again while other processes' load exceeded CONTENDED_CORES (as
    plan.source.measure_quietly; at most `attempts` times): the plan of the least contended attempt, every
    attempt's figures in one Recorder (a cell takes the fastest: interference only adds time), the seconds
    measured and each attempt's others' cores."""
    best: tuple[float, ExecutionPlan] | None = None
    merged = Recorder(lambda method, rows, threads: {})
    loads: list[float] = []
    spent = 0.0
    for _ in range(attempts):
        wait_quiet(max_wait_s)
        busy0, own0 = cpu_busy_seconds()
        t0 = time.perf_counter()
        plan, recorder = measure(instances, rounds)
        took = time.perf_counter() - t0
        busy1, own1 = cpu_busy_seconds()
        others = max(0.0, (busy1 - busy0) - (own1 - own0)) / max(took, 1e-9)
        spent += took
        loads.append(round(others, 2))
        for where, by_method in recorder.seen.items():
            for name, samples in by_method.items():
                merged.seen.setdefault(where, {}).setdefault(name, []).extend(samples)
        if best is None or others < best[0]:
            best = (others, plan)
        if others <= CONTENDED_CORES:
            break
        logger.info("other processes kept %.2f cores busy while the plan was measured", others)
    assert best is not None
    return best[1], merged, spent, loads


def cells_of(plan: ExecutionPlan, recorder: Recorder, where: dict[str, str]) -> list[Cell]:
    """One cell per (key, bucket) the plan timed: `where` (family, dtype, quantization) and its figures."""
    out = []
    for (key, rows), by_method in sorted(recorder.seen.items(), key=lambda kv: (kv[0][0].label(), kv[0][1])):
        seconds = {m: min(s) for m, s in by_method.items()}
        winner = min(seconds, key=lambda m: seconds[m])
        rule = plan.gemms.get(key)
        out.append({**where, "shape": key.label(), "storage": key.storage, "bucket": rows, "seconds": seconds,
                    "rounds": {m: len(s) for m, s in by_method.items()}, "winner": winner,
                    "near": sorted(m for m, s in seconds.items() if s <= seconds[winner] * (1 + NEAR)),
                    "plan": rule.method_for(rows) if rule is not None else ""})
    return out


def dropped(cells: list[Cell], limit: dict[str, int]) -> dict[str, int]:
    """Per method, the cells it was not timed in though it was at a smaller bucket of the same configuration and
    shape and serves the bucket's rows (its `max_rows`): the timer's cutoff (a product HOPELESS squared slower
    than the fastest seen is not timed at larger buckets), which a burst of other processes' load can trip.
    `limit`: each method's `max_rows` (0: any)."""
    out = dict.fromkeys(limit, 0)
    series: dict[tuple[object, ...], list[Cell]] = {}
    for c in cells:
        series.setdefault(tuple(c[k] for k in ("family", "dtype", "quantization", "shape")), []).append(c)
    for row in series.values():
        seen: set[str] = set()
        for c in sorted(row, key=lambda c: c["bucket"]):  # type: ignore[arg-type,return-value]
            for m in seen - set(c["seconds"]):  # type: ignore[arg-type]
                out[m] += not limit[m] or c["bucket"] <= limit[m]  # type: ignore[operator]
            seen |= set(c["seconds"])  # type: ignore[arg-type]
    return out


def lost_cells(configs: list[Cell], cells: list[Cell]) -> list[str]:
    """The (configuration, shape, bucket)s the plan times (a site's `timed_rows`) where no method was timed."""
    have = {tuple(c[k] for k in ("family", "dtype", "quantization", "shape", "bucket")) for c in cells}
    out = []
    for conf in configs:
        where = tuple(conf[k] for k in ("family", "dtype", "quantization"))
        for shape, most in conf.get("timed_rows", {}).items():  # type: ignore[attr-defined]
            out += [f"{' '.join(map(str, where))} {shape} @{b}" for b in ROW_BUCKETS
                    if (not most or b <= most) and (*where, shape, b) not in have]
    return out


def summarize(cells: list[Cell], configs: list[Cell], candidates: dict[str, int]) -> dict[str, object]:
    """Per method: cells timed, won (`clear`: by more than CLEAR; `sole`: as the only candidate), within NEAR of the
    winner, picked by the plan, `dropped`; the methods that win nowhere, never timed, and those another method
    covers (timed wherever it is, at most NEAR slower); the cells no method was timed in. `candidates`: the
    methods surveyed with their `max_rows`."""
    names = list(candidates)
    per = {m: {"timed": 0, "wins": 0, "clear": 0, "sole": 0, "near": 0, "plan": 0, "dropped": n}
           for m, n in dropped(cells, candidates).items()}
    for c in cells:
        for m in c["seconds"]:  # type: ignore[union-attr]
            per[m]["timed"] += 1
        per[str(c["winner"])]["wins"] += 1
        per[str(c["winner"])]["sole"] += len(c["seconds"]) == 1  # type: ignore[arg-type]
        ranked = sorted(c["seconds"].values())  # type: ignore[union-attr]
        per[str(c["winner"])]["clear"] += len(ranked) > 1 and ranked[1] > ranked[0] * (1 + CLEAR)
        for m in c["near"]:  # type: ignore[union-attr]
            per[m]["near"] += 1
        if c["plan"]:
            per[str(c["plan"])]["plan"] += 1
    covered: dict[str, list[str]] = {}
    substitute: dict[str, dict[str, object]] = {}
    for a in names:
        mine = [c["seconds"] for c in cells if a in c["seconds"]]  # type: ignore[operator]
        ratios = {b: [s.get(b, float("inf")) / s[a] for s in mine] for b in names if b != a}  # type: ignore[attr-defined]
        covered[a] = [b for b, r in ratios.items() if mine and max(r) <= 1 + NEAR]
        if mine and any(per[a][k] for k in ("wins", "plan")):  # the method closest to taking its place
            b = min(ratios, key=lambda b: (sum(x > 1 + NEAR for x in ratios[b]), max(ratios[b])))
            timed = [x for x in ratios[b] if x != float("inf")]
            substitute[a] = {"by": b if timed else "none", "cells_worse": sum(x > 1 + NEAR for x in ratios[b]),
                             "cells": len(mine), "untimed": len(mine) - len(timed),
                             "worst": round(max(timed, default=0.0), 2)}
    return {"methods": per, "never_timed": [m for m in names if not per[m]["timed"]],
            "never_win": [m for m in names if per[m]["timed"] and not per[m]["wins"]],
            "never_picked": [m for m in names if per[m]["timed"] and not per[m]["plan"]],
            "covered_by": {a: bs for a, bs in covered.items() if bs}, "substitute": substitute,
            "lost_cells": lost_cells(configs, cells)}


def survey(families: list[str], dtypes: list[str], quantizations: list[str], rounds: int, tiny: bool,
           workdir: Path, attempts: int = 1, max_wait_s: float = 0.0,
           on_config: Callable[[list[Cell], list[Cell]], None] | None = None) -> tuple[list[Cell], list[Cell]]:
    """(the configurations surveyed, with their times and the other processes' load; every cell);
    `on_config(configs, cells)` after each configuration (the results so far)."""
    configs: list[Cell] = []
    cells: list[Cell] = []
    for family in families:
        cfg, real_experts = family_config(family, tiny)
        t0 = time.perf_counter()
        model_dir = write_checkpoint(str(workdir / family), cfg)
        logger.info("%s: checkpoint written in %.0f s", family, time.perf_counter() - t0)
        for dtype in dtypes:
            for quant in quantizations:
                where = {"family": family, "dtype": dtype, "quantization": quant}
                t0 = time.perf_counter()
                model = load_survey_model(model_dir, dtype, quant)
                built = str(model.dtype).removeprefix("torch.")
                if built != dtype:  # the loader computes a 16-bit dtype this CPU cannot multiply in float32
                    configs.append({**where, "skipped": f"the loader builds {built} on this CPU"})
                    logger.warning("%s: skipped (the loader builds %s on this CPU)", where, built)
                    continue
                instances = survey_instances(model, real_experts)
                plan, recorder, spent, loads = measured_quietly(instances, rounds, attempts, max_wait_s)
                found = cells_of(plan, recorder, where)
                cells.extend(found)
                timed_rows = {GemmKey.of(site).label(): site.timed_rows for site, _ in instances}
                configs.append({**where, "sites": len(instances), "timed_rows": timed_rows,
                                "cells": len(found), "rounds": rounds, "measure_s": round(spent, 1),
                                "total_s": round(time.perf_counter() - t0, 1), "others_cores": min(loads),
                                "attempts_others_cores": loads})
                logger.info("%s: %d cells measured in %.0f s (other processes: %s cores)", where, len(found),
                            spent, loads)
                if on_config is not None:
                    on_config(configs, cells)
                del model, instances, plan, recorder
    return configs, cells


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.0f}" if seconds < 0.1 else f"{seconds * 1e6:.3g}"


def report(data: dict[str, object]) -> Iterator[str]:
    """The text report: the run, each configuration's cells (us per product), then the summary."""
    meta = data["meta"]
    yield f"plan survey: {json.dumps(meta)}"
    cells: list[dict] = data["cells"]  # type: ignore[assignment]
    for conf in data["configs"]:  # type: ignore[union-attr]
        head = f"{conf['family']} {conf['dtype']} quantization={conf['quantization']}"
        if "skipped" in conf:
            yield f"\n== {head}: skipped ({conf['skipped']})"
            continue
        yield (f"\n== {head}: {conf['sites']} sites, {conf['cells']} cells, measured in {conf['measure_s']} s "
               f"(other processes' cores per attempt: {conf['attempts_others_cores']})")
        mine = [c for c in cells if all(c[k] == conf[k] for k in ("family", "dtype", "quantization"))]
        for shape in dict.fromkeys(c["shape"] for c in mine):
            rows = [c for c in mine if c["shape"] == shape]
            methods = [m for m in meta["candidates"] if any(m in c["seconds"] for c in rows)]  # type: ignore[index]
            yield f"  {shape} (us per product)"
            yield "    " + f"{'rows':>5} " + " ".join(f"{m:>15}" for m in methods) + f" {'winner':>15} {'plan':>15}"
            for c in rows:
                vals = " ".join(f"{_us(c['seconds'][m]) if m in c['seconds'] else '-':>15}" for m in methods)
                yield f"    {c['bucket']:>5} {vals} {c['winner']:>15} {c['plan']:>15}"
    summary: dict = data["summary"]  # type: ignore[assignment]
    yield (f"\n== summary over {len(cells)} cells. timed: cells a method was timed in; wins: fastest there; clear: "
           f"of those, by more than {CLEAR:.0%}; sole: as the only candidate; near: within {NEAR:.0%} of the fastest; "
           "plan: the plan binds it there")
    yield ("  dropped: cells at a larger bucket it serves but was not timed in (the timer's HOPELESS^2 cutoff: a "
           "method hopelessly slow there, or one a burst of other processes' load made look so)")
    yield f"  {'method':>16} " + " ".join(f"{k:>6}" for k in COLUMNS) + "  wins by storage/dtype"
    for name, n in summary["methods"].items():
        by: dict[str, int] = {}
        for c in cells:
            kind = f"{c['storage']}{' experts' if c['shape'].endswith(' experts') else ''}/{c['dtype']}"
            by[kind] = by.get(kind, 0) + (c["winner"] == name)
        counts = " ".join(f"{n[k]:>{max(6, len(k))}}" for k in COLUMNS)
        yield f"  {name:>16} {counts}  " + ", ".join(f"{k} {v}" for k, v in sorted(by.items()) if v)
    yield f"  never timed (no surveyed site supports them): {', '.join(summary['never_timed']) or 'none'}"
    yield f"  win nowhere: {', '.join(summary['never_win']) or 'none'}"
    yield f"  never picked by the plan: {', '.join(summary['never_picked']) or 'none'}"
    yield "  everywhere within 3 % of another method (that method timed in every cell it is, never >3 % slower):"
    for a, bs in summary["covered_by"].items():
        yield f"    {a}: {', '.join(bs)}"
    if not summary["covered_by"]:
        yield "    none"
    yield ("  closest substitute of each method that wins or is picked somewhere (the other method more than 3 % "
           "slower, or untimed, in the fewest of its cells; worst: its largest time ratio where timed):")
    for a, sub in summary.get("substitute", {}).items():
        yield (f"    {a:>16}: {sub['by']} worse in {sub['cells_worse']} of {sub['cells']} cells ({sub['untimed']} of "
               f"them untimed), worst x{sub['worst']}")
    lost = summary.get("lost_cells", [])
    yield f"  cells the plan times where no method was timed (all cut off): {len(lost)}"
    yield from (f"    {cell}" for cell in lost)


def _names(text: str, allowed: Sequence[str], flag: str, parser: argparse.ArgumentParser) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        parser.error(f"{flag}: unknown {', '.join(bad) or 'empty list'} (choose from {', '.join(allowed)})")
    return names


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated, of {', '.join(FAMILIES)}")
    p.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated model dtypes")
    p.add_argument("--quantizations", default=",".join(QUANTIZATIONS), help="comma-separated; none: dense weights")
    p.add_argument("--rounds", type=int, default=MEASURE_ROUNDS,
                   help="measurement rounds per bucket (the plan's MEASURE_ROUNDS)")
    p.add_argument("--out-json", type=Path, default=DEFAULT_JSON, help="where the machine-readable result goes")
    p.add_argument("--out-text", type=Path, default=None, help="also write the text report here")
    p.add_argument("--attempts", type=int, default=3,
                   help="measure a configuration again while other processes loaded the CPU (each cell the fastest)")
    p.add_argument("--max-wait", type=float, default=120.0,
                   help="seconds to wait for other processes to quieten before each measurement")
    p.add_argument("--tiny", action="store_true", help="tiny widths (a smoke test in seconds, not a measurement)")
    p.add_argument("--workdir", type=Path, default=None, help="where the checkpoints go (a temporary directory)")
    p.add_argument("--merge", default="", help="comma-separated JSON files of earlier runs: report them as one")
    p.add_argument("--log-level", default="INFO")
    ns = p.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    families = _names(ns.families, list(FAMILIES), "--families", p)
    dtypes = _names(ns.dtypes, DTYPES, "--dtypes", p)
    quants = _names(ns.quantizations, QUANTIZATIONS, "--quantizations", p)
    if ns.rounds < 1 or ns.attempts < 1:
        p.error("--rounds and --attempts must be >= 1")
    start = time.perf_counter()
    meta = {**cpu_identity(), "torch": torch.__version__, "threads": torch.get_num_threads(), "rounds": ns.rounds,
            "reps": PLAN_REPS, "attempts": ns.attempts, "buckets": list(ROW_BUCKETS), "tiny": ns.tiny,
            "candidates": {m.name: m.max_rows for m in THROUGHPUT_KERNELS}, "elapsed_s": 0.0,
            "worker_proc": str(Path(execution_plan.__file__).resolve().parents[2])}

    def save(configs: list[Cell], cells: list[Cell], text_too: bool = False) -> dict[str, object]:
        meta["elapsed_s"] = round(time.perf_counter() - start, 1)
        summary = summarize(cells, configs, meta["candidates"])  # type: ignore[arg-type]
        data = {"meta": meta, "configs": configs, "cells": cells, "summary": summary}
        write(ns.out_json, json.dumps(data, indent=1) + "\n")
        if text_too and ns.out_text is not None:
            write(ns.out_text, "\n".join(report(data)) + "\n")
        return data

    if ns.merge:  # earlier runs' results as one survey
        parts = [json.loads(Path(f).read_text()) for f in ns.merge.split(",")]
        meta = {**parts[0]["meta"], "elapsed_s": sum(d["meta"]["elapsed_s"] for d in parts), "merged": ns.merge}
        start = time.perf_counter() - meta["elapsed_s"]
        data = save([c for d in parts for c in d["configs"]], [c for d in parts for c in d["cells"]], True)
    else:
        flush_denormals()  # what a worker process sets up before its load (worker_proc.process)
        bound_onednn_caches()
        map_load_blocks()
        with tempfile.TemporaryDirectory(prefix="plan-survey-", dir=ns.workdir) as tmp:
            configs, cells = survey(families, dtypes, quants, ns.rounds, ns.tiny, Path(tmp), ns.attempts,
                                    ns.max_wait, on_config=save)
        data = save(configs, cells, True)
    sys.stdout.write("\n".join(report(data)) + "\n")
    return 0


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)

if __name__ == "__main__":
    sys.exit(main())
