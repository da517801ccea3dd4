"""Where a worker's execution plan comes from (`plan_for`): a pinned file, the on-disk cache, or a
fresh measurement, and the plan's file format.

A measured plan is stored under the cache directory keyed by everything its timings depend on
(`plan_key`: the CPU model and its instruction sets, the cores the rank may use, the thread options,
torch's version, the mode, the candidate methods, the kernel set timed with them and the source of the
fused CPU kernels (a new build of them is timed again), the row buckets and rounds measured, the model's
product shapes, whether second weight copies may be kept, the pages the weights lie on, the allocator
policy the products were timed under); a restart with the same key reads it instead of measuring.
`--execution-plan FILE` pins a plan: it is used as it is (measured elsewhere, edited by hand) and
refused at start-up when it lacks a rule for one of the model's shapes. Writes are atomic (a rank
reads a whole file or none), so ranks measuring the same key at once only race to the same content.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from shared.errors import ModelLoadError
from worker_proc.host.memory import WEIGHT_STORAGE, last_level_cache_bytes
from worker_proc.kernels import KernelOps, native
from worker_proc.linear.formats import THROUGHPUT_KERNELS
from worker_proc.plan.execution_plan import (
    ExecutionPlan,
    GemmRule,
    accelerator_plan,
    choose,
    deterministic_plan,
    instances_of,
)
from worker_proc.plan.method_choice import copy_affordable
from worker_proc.plan.mixer_timer import MixerTimer
from worker_proc.plan.product_timer import GemmKey, ProductTimer, read_bytes_per_s, weight_bytes
from worker_proc.plan.tuning import (
    CHOICE_REVISION,
    CONTENDED_CORES,
    COPY_PAYS,
    DEFAULT_STREAM_BYTES,
    MARGIN,
    MEASURE_ATTEMPTS,
    MEASURE_ROUNDS,
    PLAN_REPS,
    ROW_BUCKETS,
    SPARE_COPY_FRACTION,
    STREAM_ROWS,
    SWITCH_MARGIN,
)

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve")


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/hyssm/execution-plans` (`~/.cache/...` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hyssm" / "execution-plans"


def cpu_identity() -> dict[str, object]:
    """The CPU model name and the instruction sets products depend on (from /proc/cpuinfo on Linux)."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                field, _, value = line.partition(":")
                if field.strip() == "model name":
                    name = value.strip()
                elif field.strip() in ("flags", "Features"):
                    flags = set(value.split())
                if name and flags:
                    break
    except OSError:
        pass
    return {"cpu": name, "flags": sorted(f for f in CPU_FLAGS if f in flags)}


def plan_key(model: nn.Module, mode: str, thread_options: tuple[int, ...], cores: int,
             kernels: str = "", single_copy: bool = False) -> dict[str, object]:
    shapes: dict[str, int] = {}
    for site, _ in instances_of(model):
        label = GemmKey.of(site).label() + (" (dense kept)" if site.dense_kept else "")  # the copies rule reads it
        shapes[label] = shapes.get(label, 0) + 1
    return {**cpu_identity(), "cores": cores, "threads": list(thread_options), "torch": torch.__version__,
            "mode": mode, "methods": {m.name: m.max_rows for m in THROUGHPUT_KERNELS}, "kernels": kernels,
            "native": native.build_digest() if native.load() else "",  # the fused kernels' code is timed too
            "buckets": list(ROW_BUCKETS), "rounds": MEASURE_ROUNDS, "stream_rows": STREAM_ROWS,
            "weight_storage": WEIGHT_STORAGE, "choice": CHOICE_REVISION,
            "shapes": dict(sorted(shapes.items())), "copies": "one" if single_copy else "affordable",
            "tuning": {"margin": MARGIN, "switch_margin": SWITCH_MARGIN, "copy_pays": COPY_PAYS,
                       "spare_copy_fraction": SPARE_COPY_FRACTION}}


def key_digest(key: dict[str, object]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def plan_to_json(plan: ExecutionPlan, key: dict[str, object] | None = None) -> dict[str, object]:
    gemms = [{"out": k.out_features, "in": k.in_features, "dtype": k.dtype, "storage": k.storage, "experts": k.experts,
              "bounds": list(r.bounds),
              "methods": list(r.methods), "timings_s": {str(b): t for b, t in r.timings.items()}}
             for k, r in sorted(plan.gemms.items(), key=lambda kv: kv[0].label())]
    return {"version": FORMAT_VERSION, "key": key or {}, "mode": plan.mode,
            "threads": [list(t) for t in plan.threads], "weight_bytes": plan.weight_bytes,
            "read_bytes_per_s": plan.read_bytes_per_s, "gemms": gemms}


def plan_from_json(data: dict[str, object], source: str) -> ExecutionPlan:
    """Parse a plan file's content; ValueError naming what is wrong."""
    if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
        raise ValueError(f"not an execution plan of format version {FORMAT_VERSION}")
    try:
        gemms = {
            GemmKey(int(g["out"]), int(g["in"]), str(g["dtype"]), str(g.get("storage", "dense")),
                    bool(g.get("experts", False))): GemmRule(
                tuple(int(b) for b in g["bounds"]), tuple(str(m) for m in g["methods"]),
                {int(b): dict(t) for b, t in g.get("timings_s", {}).items()})
            for g in data["gemms"]  # type: ignore[union-attr]
        }
        threads = tuple((int(b), int(n)) for b, n in data["threads"])  # type: ignore[union-attr]
        weight_bytes = int(data.get("weight_bytes", 0))  # type: ignore[arg-type]
        read = float(data.get("read_bytes_per_s", 0.0))  # type: ignore[arg-type]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"malformed execution plan ({type(e).__name__}: {e})") from e
    if any(n < 1 for _, n in threads):
        raise ValueError("an execution plan's thread counts must be >= 1")
    return ExecutionPlan(str(data.get("mode", "throughput")), gemms, threads, source, weight_bytes, read)


def write_plan(path: Path, plan: ExecutionPlan, key: dict[str, object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".plan-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(plan_to_json(plan, key), f, indent=1)
    os.replace(tmp, path)


def read_plan(path: Path, source: str) -> ExecutionPlan:
    with open(path) as f:
        return plan_from_json(json.load(f), source)


def plan_for(model: nn.Module, device: torch.device, *, deterministic: bool, thread_options: tuple[int, ...],
             cores: int, pinned: str = "", cache_dir: Path | None = None,
             ops: KernelOps | None = None, single_copy: bool = False) -> ExecutionPlan:
    """The rank's plan (see the module doc). `thread_options`: the thread counts a step may run on
    (empty: torch's setting is left alone and products are timed on it); `cache_dir` None: no cache; `ops`:
    the kernel set whose recurrent kernels are timed with the products (None: products only);
    `single_copy`: a measured plan keeps no second copy of any weight, affordable or not. A worker measures
    once its weights are loaded, under the steps' allocator policy (worker_proc.host.memory)."""
    if device.type != "cpu":
        return accelerator_plan(model)
    if deterministic:
        return deterministic_plan(model, max(thread_options, default=0))
    if pinned:
        try:
            plan = read_plan(Path(pinned), f"pinned {pinned}")
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"--execution-plan {pinned}: {e}") from e
        missing = {GemmKey.of(s).label() for s, _ in instances_of(model)} - {k.label() for k in plan.gemms}
        if missing:
            raise ModelLoadError(f"--execution-plan {pinned} has no rule for {', '.join(sorted(missing))}")
        return plan
    options = thread_options or (torch.get_num_threads(),)
    key = plan_key(model, "throughput", options, cores, ops.name if ops is not None else "", single_copy)
    path = cache_dir / f"plan-{key_digest(key)}.json" if cache_dir is not None else None
    if path is not None and path.exists():
        try:
            return read_plan(path, f"cached {path}")
        except (OSError, ValueError) as e:
            logger.warning("ignoring the cached execution plan %s (%s): measuring again", path, e)
    plan, quiet = measure_quietly(model, options, ops, single_copy, cores)
    if path is not None and not quiet:
        logger.warning("the execution plan was measured while other processes kept the CPU busy: it is not "
                       "saved, and the next start measures again")
    elif path is not None:
        try:
            write_plan(path, plan, key)
            plan = dataclasses.replace(plan, source=f"measured, saved to {path}")
        except OSError as e:
            logger.warning("cannot save the execution plan to %s: %s", path, e)
    return plan


def never_affordable(nbytes: int) -> bool:
    """The `--single-weight-copy` rule: no second copy, whatever its size."""
    return False






def contended(others_cores: float, thread_options: tuple[int, ...], cores: int) -> bool:
    """Whether other processes' average load (`others_cores`, in cores) during a measurement took from the
    cores this rank measures on: load up to the cores past its largest thread count (another rank's share,
    on a node that runs several ranks measuring at once) takes none of them; past that, CONTENDED_CORES is
    the noise allowed. `cores`: the cores the rank may run on (0: unknown, then all load counts)."""
    spare = max(0, cores - max(thread_options, default=1)) if cores > 0 else 0
    return others_cores > spare + CONTENDED_CORES


def cpu_busy_seconds() -> tuple[float, float]:
    """(seconds every CPU of the machine spent busy, including time the hypervisor took; seconds this
    process ran), both since boot; (0, 0) where /proc/stat cannot be read."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    own = os.times()
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK"), own.user + own.system


def measure_quietly(model: nn.Module, thread_options: tuple[int, ...], ops: KernelOps | None = None,
                    single_copy: bool = False, cores: int = 0) -> tuple[ExecutionPlan, bool]:
    """`measure_plan`, again while other processes' load was `contended` (at most MEASURE_ATTEMPTS times);
    the flag says whether the last measurement was quiet."""
    for attempt in range(1, MEASURE_ATTEMPTS + 1):
        busy0, own0 = cpu_busy_seconds()
        t0 = time.perf_counter()
        plan = measure_plan(model, thread_options, ops, single_copy)
        busy1, own1 = cpu_busy_seconds()
        others = max(0.0, (busy1 - busy0) - (own1 - own0)) / max(time.perf_counter() - t0, 1e-9)
        if not contended(others, thread_options, cores):
            return plan, True
        logger.info("other processes kept %.2f cores busy while the plan was measured (attempt %d of %d)",
                    others, attempt, MEASURE_ATTEMPTS)
    return plan, False


def measure_plan(model: nn.Module, thread_options: tuple[int, ...], ops: KernelOps | None = None,
                 single_copy: bool = False) -> ExecutionPlan:
    """Time the model's products (and recurrent kernels, given `ops`) and choose."""
    instances = instances_of(model)
    before = torch.get_num_threads()
    cap = DEFAULT_STREAM_BYTES if single_copy else 0
    own_only = frozenset(GemmKey.of(s) for s, _ in instances if s.dense_kept) if single_copy else frozenset()
    timer = ProductTimer(instances, last_level_cache_bytes(), reps=PLAN_REPS, max_stream_bytes=cap,
                         own_weights_only=own_only)
    t0 = time.perf_counter()
    logger.info("measuring the execution plan: %d product sites, threads %s", len(instances), thread_options)
    try:
        timed = ops is not None and len(thread_options) > 1
        mixers = MixerTimer(model, ops) if timed and ops is not None else None
        affordable = never_affordable if single_copy else copy_affordable
        plan = choose(instances, thread_options, timer, affordable, mixers)
        torch.set_num_threads(max(thread_options))
        plan = dataclasses.replace(plan, weight_bytes=weight_bytes(instances),
                                   read_bytes_per_s=read_bytes_per_s(instances))
    finally:
        timer.release()
        torch.set_num_threads(before)
    logger.info("execution plan measured in %.1f s", time.perf_counter() - t0)
    return plan
