"""The execution plan of a worker rank: the one place that decides which method runs each matrix
product at each row count, and how many torch threads a step of a given size runs on.

Built once per rank after the weights are loaded (`plan_for`, worker_proc.plan_cache) and bound to
the model (`ExecutionPlan.bind`); nothing else changes how a product runs. Rules:
- not on the CPU: every product is `dense` (F.linear: cuBLAS picks its own kernels);
- the deterministic mode: every product is `padded` (batch invariant), on one thread count;
- otherwise, by measurement on this machine (`choose`): for each weight shape and dtype and each row
  bucket (`ROW_BUCKETS`: a product of r rows takes the rule of the smallest bucket >= r, the largest
  beyond it) the fastest of `THROUGHPUT_METHODS`, at the thread count whose products and recurrent
  kernels of a step of that many rows take the least time over the whole model. `dense` is kept
  unless another method is more than `MARGIN` faster, and fewer threads unless more are more than
  `MARGIN` faster (timing noise must not buy a second weight copy or a second woken core). Second
  copies (a dense weight also read packed or tiled, a quantized weight's int8 copy) are kept only when
  all of them together are affordable (worker_proc.host_memory.copy_affordable); else the dense shapes
  keep the set of layouts their buckets lose least with among those that fit, a quantized one its own
  values only, and a weight its owner also reads as stored (a tied LM head) takes the copies its fastest
  methods read only in the room those layouts leave.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from worker_proc.kernels.select import KernelChoice
from worker_proc.model.gemm import (
    ACCELERATOR,
    COPIES,
    DENSE,
    DEQUANT,
    DETERMINISTIC,
    METHODS,
    THROUGHPUT_METHODS,
    GemmMethod,
    GemmOwner,
    GemmSite,
)
from worker_proc.model.layers import Linear
from worker_proc.plan_timing import GemmKey, Instance, Measure

logger = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
"""Row counts the plan measures: decode batches up to 64 rows, prefill steps up to the default chunk (512).
A library product's cost is not linear between them (a dense bfloat16 product of 128 rows can cost what
one of 256 does: oneDNN reorders the weight on every call), so each size a step commonly has is its own."""
MARGIN = 0.03
SWITCH_MARGIN = 0.05
"""A product keeps the method of the next smaller row bucket unless another is more than this much faster,
and a step its thread count likewise: two choices a few percent apart trade places from one timing to the
next, and a rule that flips between them at every bucket is noise, not a measurement."""
MEASURE_ROUNDS = 3
"""Every (rows, threads) figure is the fastest of this many rounds, the thread counts taking turns: the
worker measures while its sibling processes start, and a burst of theirs must not decide a choice that is
cached for every later start."""
CHOICE_REVISION = 2
"""Part of a cached plan's key: raised whenever the way `choose` turns timings into rules changes, so that a
plan cached by an older rule is measured again rather than served (a pinned plan is read as it is)."""
CONTENDER = 2.0
"""A round after the first times again only the methods within this factor of a key's fastest (one slower
than twice the fastest does not win by a burst that slowed the fastest in the first round)."""


@dataclass(frozen=True)
class GemmRule:
    """`methods[i]` for products of at most `bounds[i]` rows, the last one for every larger product;
    `timings`: the measured seconds per product, by bucket and method (for the log and the file)."""

    bounds: tuple[int, ...]
    methods: tuple[str, ...]
    timings: dict[int, dict[str, float]] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if len(self.methods) != len(self.bounds) + 1 or any(m not in METHODS for m in self.methods):
            raise ValueError(f"bad rule: bounds {self.bounds}, methods {self.methods}")

    def method_for(self, rows: int) -> str:
        return self.methods[bisect_left(self.bounds, rows)]


def rule_from_buckets(per_bucket: list[str], timings: dict[int, dict[str, float]] | None = None) -> GemmRule:
    """Merge runs of equal choices over `ROW_BUCKETS` into bounds."""
    bounds: list[int] = []
    methods = [per_bucket[0]]
    for i in range(1, len(per_bucket)):
        if per_bucket[i] != per_bucket[i - 1]:
            bounds.append(ROW_BUCKETS[i - 1])
            methods.append(per_bucket[i])
    return GemmRule(tuple(bounds), tuple(methods), timings or {})


@dataclass(frozen=True)
class ExecutionPlan:
    """What runs where (see the module doc). `threads`: (bound, count) pairs, a step of r token rows
    on the count of the first bound >= r (the last pair's beyond them); empty: torch's setting is left
    alone. `source`: how the plan was made (measured, cached FILE, pinned FILE, a fixed rule).
    `weight_bytes` / `read_bytes_per_s`: the products' weights and how fast the rank read them when the
    plan was measured (their ratio is a one-row step's floor; 0 where not measured)."""

    mode: str
    gemms: dict[GemmKey, GemmRule]
    threads: tuple[tuple[int, int], ...] = ()
    source: str = "fixed"
    weight_bytes: int = 0
    read_bytes_per_s: float = 0.0
    kernels: KernelChoice | None = None
    """The mixers' kernel set (worker_proc.kernels.select; decided by the flags, not measured, so not cached)."""

    def threads_for(self, rows: int) -> int:
        bounds = [b for b, _ in self.threads]
        return self.threads[min(bisect_left(bounds, rows), len(self.threads) - 1)][1]

    def apply_threads(self, rows: int) -> None:
        """Set torch's intra-op thread count for a step of `rows` token rows (a no-op when unchanged)."""
        if self.threads:
            n = self.threads_for(rows)
            if torch.get_num_threads() != n:
                torch.set_num_threads(n)

    def bind(self, model: nn.Module) -> None:
        """Give every product site of `model` its rule (making the copies of its weight that the rule's
        methods read; a Linear whose rule reads only copies drops its dense weight, and gets it back from
        them when bound again). A site that cannot hold a copy (an expert stack's, of a shape a Linear
        shares) takes the rule without copies."""
        for owner, site, weight in product_sites(model):
            key = GemmKey.of(site)
            rule = self.gemms.get(key)
            if rule is None:
                raise ValueError(f"the execution plan has no rule for {key.label()} products")
            if not site.packable and any(METHODS[m].storage in COPIES for m in rule.methods):
                rule = _without_copies(rule)
            methods = tuple(METHODS[m] for m in rule.methods)
            if isinstance(owner, Linear) and site.quantized is None and site.copies and weight.numel() == 0:
                weight = site.dense_from_copies()  # bound before to copies only: the dense weight was dropped
                owner.weight = nn.Parameter(weight, requires_grad=False)
            copies = {m.storage: COPIES[m.storage](weight) for m in methods if m.storage in COPIES}
            site.bind(rule.bounds, methods, copies)
            if isinstance(owner, Linear) and "dense" not in site.storages:
                owner.weight = nn.Parameter(weight.new_empty(0), requires_grad=False)

    def describe(self) -> Iterator[str]:
        """The kernel set, one line per product shape, then the thread rule."""
        if self.kernels is not None:
            yield self.kernels.describe()
        for key, rule in sorted(self.gemms.items(), key=lambda kv: kv[0].label()):
            parts = []
            lower = 1
            for bound, method in zip((*rule.bounds, None), rule.methods, strict=True):
                span = f"rows {lower}+" if bound is None else f"rows {lower}-{bound}"
                parts.append(f"{span}: {method}")
                lower = (bound or 0) + 1
            timed = "; ".join(f"{b}: " + " ".join(f"{m} {s * 1e6:.0f}us" for m, s in t.items())
                              for b, t in sorted(rule.timings.items()))
            yield f"{key.label()}: {', '.join(parts)}" + (f" (measured {timed})" if timed else "")
        if self.read_bytes_per_s > 0:
            yield (f"weights {self.weight_bytes / 2**20:.0f} MiB read at {self.read_bytes_per_s / 1e9:.1f} GB/s: "
                   f"a one-row step's floor is {self.weight_bytes / self.read_bytes_per_s * 1e3:.1f} ms")
        if self.threads:
            yield "threads: " + ", ".join(f"rows <= {b}: {n}" for b, n in self.threads[:-1]) + (
                f"{', ' if len(self.threads) > 1 else ''}larger: {self.threads[-1][1]}")


def product_sites(model: nn.Module) -> Iterator[tuple[GemmOwner, GemmSite, torch.Tensor]]:
    for module in model.modules():
        if isinstance(module, GemmOwner):
            for site, weight in module.gemm_sites():
                yield module, site, weight


def fixed_plan(model: nn.Module, methods: dict[str, GemmMethod], threads: int = 0,
               mode: str = "fixed") -> ExecutionPlan:
    """Every product on the method `methods` names for its weight's storage, or on the format's
    `dequant` product where that method cannot read a site's weight (block-scaled fp8 under a per-row
    product); every step on `threads` (0: torch's setting left alone)."""
    device = getattr(model, "device", torch.device("cpu"))
    chosen: dict[GemmKey, GemmMethod] = {}
    for _, site, _ in product_sites(model):
        key = GemmKey.of(site)
        method = methods[site.storage_format]
        if not method.supports(site, device) or chosen.get(key, method) is not method:
            method = DEQUANT[site.storage_format] if site.quantized is not None else method
        chosen[key] = method
    used = sorted({m.name for m in chosen.values()})
    return ExecutionPlan(mode, {k: GemmRule((), (m.name,)) for k, m in chosen.items()},
                         ((1, threads),) if threads else (), source=f"{', '.join(used)} everywhere")


def accelerator_plan(model: nn.Module) -> ExecutionPlan:
    """Each storage's product off the CPU (ACCELERATOR)."""
    return fixed_plan(model, ACCELERATOR)


def deterministic_plan(model: nn.Module, threads: int) -> ExecutionPlan:
    return fixed_plan(model, DETERMINISTIC, threads, mode="batch_invariant")


def instances_of(model: nn.Module) -> list[Instance]:
    return [(site, weight) for _, site, weight in product_sites(model)]


def choose(instances: list[Instance], thread_options: tuple[int, ...], measure: Measure,
           affordable: Callable[[int], bool], mixers: Callable[[int, int], float] | None = None) -> ExecutionPlan:
    """The measured plan (see the module doc) over these sites. `mixers(rows, threads)`: the seconds of a
    step's recurrent kernels (worker_proc.mixer_timing), added to its products' when threads are chosen.
    Copies of weights: every layout the fastest methods read where `affordable` says the extra bytes are
    there, else the set of layouts of dense weights that loses least among those that fit, and where none
    fits the single layout that loses least."""
    counts: dict[GemmKey, int] = {}
    nbytes: dict[GemmKey, int] = {}
    kept: dict[GemmKey, int] = {}  # bytes of dense weights their owners read themselves
    for site, weight in instances:
        key = GemmKey.of(site)
        counts[key] = counts.get(key, 0) + 1
        nbytes[key] = nbytes.get(key, 0) + site.weight_bytes(weight)
        kept[key] = kept.get(key, 0) + (site.weight_bytes(weight) if site.dense_kept else 0)
    picks: dict[GemmKey, list[dict[str, float]]] = {k: [] for k in counts}
    threads: list[int] = []
    for rows in ROW_BUCKETS:
        by_threads, mixer_s = _timed_rounds(measure, mixers, rows, thread_options)
        totals = {t: sum(counts.get(k, 0) * min(ts.values()) for k, ts in timed.items()) + mixer_s[t]
                  for t, timed in by_threads.items()}
        logger.debug("plan bucket %d rows: step seconds by threads %s", rows,
                     {t: round(v, 6) for t, v in totals.items()})
        best = min(thread_options, key=lambda t: (totals[t], t))
        chosen = min((t for t in thread_options if totals[t] <= totals[best] * (1 + MARGIN)), default=best)
        if threads and totals[threads[-1]] <= totals[best] * (1 + SWITCH_MARGIN):
            chosen = threads[-1]  # as a product keeps its method (`_picks`)
        threads.append(chosen)
        for key in counts:  # a bucket past the key's timed rows takes the largest bucket timed
            picks[key].append(by_threads[chosen].get(key) or (picks[key][-1] if picks[key] else {}))
    options = _layout_options({k: t for k, t in picks.items() if not kept[k]}, counts)  # fastest first
    singles = [o for o in options if o is not None and len(o) == 1]
    chosen_picks = _picks_within(picks, kept, singles[0] if singles else None)  # where no option fits
    for layouts in options:
        within = _picks_within(picks, kept, layouts)
        extra = sum(_second_copy_bytes(k, p, counts[k], nbytes[k], kept[k]) for k, p in within.items())
        if extra == 0 or affordable(extra):
            chosen_picks = within if layouts is None else _kept_copies(picks, within, kept, counts, nbytes,
                                                                       extra, affordable)
            break
    gemms = {key: rule_from_buckets(chosen_picks[key], dict(zip(ROW_BUCKETS, timed, strict=True)))
             for key, timed in picks.items()}
    rule: list[tuple[int, int]] = []
    for bucket, n in zip(ROW_BUCKETS, threads, strict=True):
        if rule and rule[-1][1] == n:
            rule[-1] = (bucket, n)
        else:
            rule.append((bucket, n))
    return ExecutionPlan("throughput", gemms, tuple(rule), source="measured")


Timings = dict[GemmKey, dict[str, float]]
"""Seconds per product by weight key and method name."""


def _timed_rounds(measure: Measure, mixers: Callable[[int, int], float] | None, rows: int,
                  thread_options: tuple[int, ...]) -> tuple[dict[int, Timings], dict[int, float]]:
    """Per thread count: the products' seconds by key and method, and the recurrent kernels' seconds, each
    the fastest of MEASURE_ROUNDS rounds in which the thread counts take turns; a later round times only
    the methods within CONTENDER of the fastest for some key."""
    products: dict[int, Timings] = {t: {} for t in thread_options}
    mixer_s = {t: float("inf") if mixers is not None else 0.0 for t in thread_options}
    for round_ in range(MEASURE_ROUNDS):
        for t in thread_options:
            only = _contenders(products[t]) if round_ else None
            for key, by_method in _timed(measure, rows, t, only).items():
                best = products[t].setdefault(key, {})
                for name, seconds in by_method.items():
                    best[name] = min(seconds, best.get(name, seconds))
            if mixers is not None:
                mixer_s[t] = min(mixer_s[t], mixers(rows, t))
    return products, mixer_s


def _contenders(timed: Timings) -> set[str]:
    return {name for by_method in timed.values() for name, seconds in by_method.items()
            if seconds <= min(by_method.values()) * CONTENDER}


def _timed(measure: Measure, rows: int, threads: int, only: set[str] | None = None) -> Timings:
    out: Timings = {}
    for method in THROUGHPUT_METHODS:
        if only is not None and method.name not in only:
            continue
        for key, seconds in measure(method, rows, threads).items():
            out.setdefault(key, {})[method.name] = seconds
    return out


def _pick(timed: dict[str, float], storage: str = "dense") -> str:
    """The fastest method, `dense` unless another beats it by more than MARGIN (nothing measured: the
    storage's reference product)."""
    if not timed:
        return DENSE.name if storage == "dense" else DEQUANT[storage].name
    best = min(timed, key=lambda m: timed[m])
    if DENSE.name in timed and timed[DENSE.name] <= timed[best] * (1 + MARGIN):
        return DENSE.name
    return best


def _picks(timed: list[dict[str, float]], storage: str = "dense") -> list[str]:
    """`_pick` of each bucket in turn, a bucket keeping the previous bucket's method while that is within
    SWITCH_MARGIN of its fastest."""
    out: list[str] = []
    for t in timed:
        pick = _pick(t, storage)
        prev = out[-1] if out else None
        if prev is not None and pick != DENSE.name and prev in t and t[prev] <= min(t.values()) * (1 + SWITCH_MARGIN):
            pick = prev
        out.append(pick)
    return out


def _without_copies(rule: GemmRule) -> GemmRule:
    """`rule` for a site that cannot hold a copy of its weight: per bucket the fastest method measured that
    reads the weight as it is (`dense` where none was)."""
    return rule_from_buckets(_picks([_own(rule.timings.get(b, {})) for b in ROW_BUCKETS]), rule.timings)


def _reads_copy(name: str) -> bool:
    """The method reads a second copy of the weight (one of `COPIES`, or a quantized weight's int8 copy)."""
    method = METHODS[name]
    return method.storage in COPIES or method.reads_int8_packed


def _own(timed: dict[str, float]) -> dict[str, float]:
    return {m: s for m, s in timed.items() if not _reads_copy(m)}


def _second_copy_bytes(key: GemmKey, per_bucket: list[str], count: int, nbytes: int, kept: int = 0) -> int:
    """Bytes these picks hold beyond one copy of the key's weights: a dense weight read as it is and as
    each of `COPIES` its methods read (a site reading only copies drops its dense weight unless its owner
    reads it: `kept` bytes), or a quantized weight's int8 copy (one byte per weight; the values stay)."""
    if key.storage == "dense":
        storages = {METHODS[m].storage for m in per_bucket}
        copies = len(storages & set(COPIES))
        if "dense" in storages:
            return nbytes * copies
        return nbytes * max(copies - 1, 0) + (kept if copies else 0)
    return count * key.out_features * key.in_features if any(_reads_copy(m) for m in per_bucket) else 0


Layouts = frozenset[str] | None
"""The storages dense weights may be read from (None: whatever the fastest methods read, a quantized
weight's int8 copy included; a set: only those, and no quantized weight's copy nor a copy of a weight
its owner reads itself)."""


def _layout_options(picks: dict[GemmKey, list[dict[str, float]]], counts: dict[GemmKey, int]) -> list[Layouts]:
    """None, then every smaller set of the dense layouts that serves every dense key's buckets: sets of more
    layouts before sets of fewer, each size ordered by the step time it loses (`_loss`)."""
    names = ("dense", *COPIES)
    dense = {k: t for k, t in picks.items() if k.storage == "dense"}
    options: list[tuple[int, float, frozenset[str]]] = []
    for mask in range(1, 2 ** len(names) - 1):
        layouts = frozenset(n for i, n in enumerate(names) if mask >> i & 1)
        loss = sum(counts[k] * _loss(t, layouts) for k, t in dense.items())
        if loss < float("inf"):
            options.append((-len(layouts), loss, layouts))
    return [None, *(o[2] for o in sorted(options, key=lambda o: (o[0], o[1], sorted(o[2]))))]


def _within(timed: dict[str, float], layouts: frozenset[str]) -> dict[str, float]:
    return {m: s for m, s in timed.items() if METHODS[m].storage in layouts}


def _loss(timed: list[dict[str, float]], layouts: frozenset[str]) -> float:
    """How much slower, summed over the buckets, the fastest methods reading only these layouts are than the
    fastest of all (inf: a bucket none of them serves)."""
    total = 0.0
    for t in timed:
        allowed = _within(t, layouts)
        if t and not allowed:
            return float("inf")
        total += min(allowed.values()) / min(t.values()) if t else 1.0
    return total


def _kept_copies(picks: dict[GemmKey, list[dict[str, float]]], chosen: dict[GemmKey, list[str]],
                 kept: dict[GemmKey, int], counts: dict[GemmKey, int], nbytes: dict[GemmKey, int], extra: int,
                 affordable: Callable[[int], bool]) -> dict[GemmKey, list[str]]:
    """`chosen` (dense layouts restricted, `extra` bytes of copies) with the weights their owners read
    themselves (the tied LM head's, read only as stored there) given the copies their fastest methods read,
    all of them or one, the set that loses least among those still affordable on top of `extra`; the key
    losing most as stored goes first. A copy of such a weight is a pure addition, so the restricted
    layouts are chosen without it and it takes only what room they leave."""
    out = dict(chosen)
    owned = [k for k in picks if kept[k] and k.storage == "dense"]
    as_stored = frozenset({"dense"})
    for key in sorted(owned, key=lambda k: -counts[k] * _loss(picks[k], as_stored)):
        best = (_loss(picks[key], as_stored), 0, out[key])
        for copies in (frozenset(COPIES), *(frozenset({c}) for c in COPIES)):
            layouts = as_stored | copies
            per_bucket = _picks([_within(t, layouts) for t in picks[key]])
            more = _second_copy_bytes(key, per_bucket, counts[key], nbytes[key], kept[key])
            loss = _loss(picks[key], layouts)
            if more and loss < best[0] and affordable(extra + more):
                best = (loss, more, per_bucket)
        out[key] = best[2]
        extra += best[1]
    return out


def _picks_within(picks: dict[GemmKey, list[dict[str, float]]], kept: dict[GemmKey, int],
                  layouts: Layouts) -> dict[GemmKey, list[str]]:
    """Each key's per-bucket methods reading only `layouts` (see `Layouts`); a dense weight its owner reads
    itself (`kept` bytes) is then read only as it is."""
    out = {}
    for key, timed in picks.items():
        if layouts is None:
            out[key] = _picks(timed, key.storage)
        elif key.storage == "dense" and not kept[key]:
            out[key] = _picks([_within(t, layouts) for t in timed])
        else:
            out[key] = [_pick(_own(t), key.storage) for t in timed]
    return out
