"""The execution plan of a worker rank: the one place that decides which kernel runs each matrix
product at each row count, and how many torch threads a step of a given size runs on.

Built once per rank after the weights are loaded (`plan_for`, worker_proc.plan.source) and bound to
the model (`ExecutionPlan.bind`); nothing else changes how a product runs. Rules:
- not on the CPU: each format's `LinearMethod.accelerator` (dense: F.linear, cuBLAS picks its own kernels);
- the deterministic mode: each format's `LinearMethod.deterministic` (batch invariant), on one thread count;
- otherwise, by measurement on this machine (`choose`): for each weight shape and dtype and each row
  bucket (`ROW_BUCKETS`: a product of r rows takes the rule of the smallest bucket >= r, the largest
  beyond it) the fastest of its format's candidates (`THROUGHPUT_KERNELS`), at the thread count whose
  products and recurrent kernels of a step of that many rows take the least time over the whole model. `dense` is kept
  unless another method is more than `MARGIN` faster, and fewer threads unless more are more than
  `MARGIN` faster (timing noise must not buy a second weight copy or a second woken core). Second
  copies (a dense weight also read packed or tiled, a quantized weight's int8 copy) are kept only when
  all of them together are affordable (worker_proc.plan.method_choice.copy_affordable); else the dense shapes
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

from worker_proc.linear.formats import LINEAR_METHODS, THROUGHPUT_KERNELS
from worker_proc.linear.kernels import KERNELS, GemmKernel
from worker_proc.linear.site import GemmOwner, GemmSite
from worker_proc.model.layers import Linear
from worker_proc.plan.kernel_set import KernelChoice
from worker_proc.plan.method_choice import choose_methods, methods_by_bucket, own_methods
from worker_proc.plan.product_timer import GemmKey, Instance, Measure
from worker_proc.plan.tuning import (
    CONTENDER,
    LORA_NATIVE_ROWS,
    MARGIN,
    MEASURE_ROUNDS,
    NO_ROW_LIMIT,
    ROW_BUCKETS,
    SWITCH_MARGIN,
)

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class GemmRule:
    """`methods[i]` for products of at most `bounds[i]` rows, the last one for every larger product;
    `timings`: the measured seconds per product, by bucket and method (for the log and the file)."""

    bounds: tuple[int, ...]
    methods: tuple[str, ...]
    timings: dict[int, dict[str, float]] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if len(self.methods) != len(self.bounds) + 1 or any(m not in KERNELS for m in self.methods):
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
    """The mixers' kernel set (worker_proc.plan.kernel_set; decided by the flags, not measured, so not cached)."""

    def lora_kernel(self) -> GemmKernel:
        """The kernel of every LoRA product (worker_proc.lora.layer): the dense format's batch-invariant one in the
        deterministic mode, else torch's own product. Not timed: an adapter's matrices are a few rows wide and
        change at run time, so no copy of them is made and there is nothing to choose between."""
        dense = LINEAR_METHODS["dense"]
        return dense.deterministic if self.mode == "batch_invariant" else dense.accelerator

    def lora_native_rows(self) -> int:
        """Up to how many rows a step adds each layer's LoRA terms with the native op (worker_proc.lora.layer):
        every step in the deterministic mode (the op is batch invariant, whatever the row count), steps of up to
        tuning.LORA_NATIVE_ROWS rows otherwise; 0 without the native kernels."""
        if self.kernels is None or self.kernels.ops != "native":
            return 0
        return NO_ROW_LIMIT if self.mode == "batch_invariant" else LORA_NATIVE_ROWS

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
            if not site.packable and any(KERNELS[m].reads_copy for m in rule.methods):
                rule = _without_copies(rule, key.storage)
            methods = tuple(KERNELS[m] for m in rule.methods)
            if isinstance(owner, Linear) and site.quantized is None and site.copies and weight.numel() == 0:
                weight = site.dense_from_copies()  # bound before to copies only: the dense weight was dropped
                owner.weight = nn.Parameter(weight, requires_grad=False)
            site.bind(rule.bounds, methods, weight)
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


def fixed_plan(model: nn.Module, kernels: dict[str, GemmKernel], threads: int = 0,
               mode: str = "fixed") -> ExecutionPlan:
    """Every product on the kernel `kernels` names for its weight's storage format, or on the format's reference
    where that kernel cannot read a site's weight (block-scaled fp8 under a per-row product); every step on
    `threads` (0: torch's setting left alone)."""
    device = getattr(model, "device", torch.device("cpu"))
    chosen: dict[GemmKey, GemmKernel] = {}
    for _, site, _ in product_sites(model):
        key = GemmKey.of(site)
        method = kernels[site.storage_format]
        if not method.supports(site, device) or chosen.get(key, method) is not method:
            method = site.method.reference
        chosen[key] = method
    used = sorted({m.name for m in chosen.values()})
    return ExecutionPlan(mode, {k: GemmRule((), (m.name,)) for k, m in chosen.items()},
                         ((1, threads),) if threads else (), source=f"{', '.join(used)} everywhere")


def accelerator_plan(model: nn.Module) -> ExecutionPlan:
    """Each format's product off the CPU (`LinearMethod.accelerator`)."""
    return fixed_plan(model, {s: m.accelerator for s, m in LINEAR_METHODS.items()})


def deterministic_plan(model: nn.Module, threads: int) -> ExecutionPlan:
    """Each format's batch-invariant product (`LinearMethod.deterministic`) on `threads` threads."""
    return fixed_plan(model, {s: m.deterministic for s, m in LINEAR_METHODS.items()}, threads, mode="batch_invariant")


def instances_of(model: nn.Module) -> list[Instance]:
    return [(site, weight) for _, site, weight in product_sites(model)]


def choose(instances: list[Instance], thread_options: tuple[int, ...], measure: Measure,
           affordable: Callable[[int], bool], mixers: Callable[[int, int], float] | None = None,
           rounds: int = MEASURE_ROUNDS) -> ExecutionPlan:
    """The measured plan (see the module doc) over these sites. `mixers(rows, threads)`: the seconds of a
    step's recurrent kernels (worker_proc.plan.mixer_timer), added to its products' when threads are chosen.
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
    timings: dict[GemmKey, list[dict[str, float]]] = {k: [] for k in counts}
    threads: list[int] = []
    for rows in ROW_BUCKETS:
        by_threads, mixer_s = _timed_rounds(measure, mixers, rows, thread_options, rounds)
        totals = {t: sum(counts.get(k, 0) * min(ts.values()) for k, ts in timed.items()) + mixer_s[t]
                  for t, timed in by_threads.items()}
        logger.debug("plan bucket %d rows: step seconds by threads %s", rows,
                     {t: round(v, 6) for t, v in totals.items()})
        best = min(thread_options, key=lambda t: (totals[t], t))
        chosen = min((t for t in thread_options if totals[t] <= totals[best] * (1 + MARGIN)), default=best)
        if threads and totals[threads[-1]] <= totals[best] * (1 + SWITCH_MARGIN):
            chosen = threads[-1]  # as a product keeps its method (`method_choice.methods_by_bucket`)
        threads.append(chosen)
        for key in counts:  # a bucket past the key's timed rows takes the largest bucket timed
            timings[key].append(by_threads[chosen].get(key) or (timings[key][-1] if timings[key] else {}))
    methods = choose_methods(timings, counts, nbytes, kept, affordable)
    gemms = {key: rule_from_buckets(methods[key], dict(zip(ROW_BUCKETS, timed, strict=True)))
             for key, timed in timings.items()}
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
                  thread_options: tuple[int, ...], rounds: int) -> tuple[dict[int, Timings], dict[int, float]]:
    """Per thread count: the products' seconds by key and method, and the recurrent kernels' seconds, each
    the fastest of `rounds` rounds in which the thread counts take turns; a later round times only
    the methods within CONTENDER of the fastest for some key."""
    products: dict[int, Timings] = {t: {} for t in thread_options}
    mixer_s = {t: float("inf") if mixers is not None else 0.0 for t in thread_options}
    for round_ in range(rounds):
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
    for method in THROUGHPUT_KERNELS:
        if only is not None and method.name not in only:
            continue
        for key, seconds in measure(method, rows, threads).items():
            out.setdefault(key, {})[method.name] = seconds
    return out


def _without_copies(rule: GemmRule, storage: str) -> GemmRule:
    """`rule` for a site that cannot hold a copy of its weight (an expert stack, a quantized one's included): per
    bucket the fastest method measured that reads the weight as it is (the storage's reference product where
    none was)."""
    per_bucket = methods_by_bucket([own_methods(rule.timings.get(b, {})) for b in ROW_BUCKETS], storage)
    return rule_from_buckets(per_bucket, rule.timings)
