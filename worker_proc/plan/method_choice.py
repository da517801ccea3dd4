"""Which method each product of a measured plan runs at each row bucket, and so which layouts (copies) of
each weight the worker keeps: from the plan's timings per key and bucket (worker_proc.plan.execution_plan.choose
measures them) and the bytes host memory affords for copies (`copy_affordable`).

Rules: `dense` unless another method is more than `MARGIN` faster; a bucket keeps the previous bucket's
method within `SWITCH_MARGIN`; a copy of a weight (a dense weight also read packed or tiled, a quantized
weight's int8 copy) only where all the copies kept fit, and only where it pays: the layouts holding the
fewest bytes win unless more make the steps' products more than `COPY_PAYS` faster; a weight its owner
reads as stored (a tied LM head) takes copies only in the room the other weights' layouts leave, and only
where they make its own products more than `COPY_PAYS` faster.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from worker_proc.host.memory import physical_memory_bytes
from worker_proc.linear.formats import LINEAR_METHODS
from worker_proc.linear.kernels import COPIES, DENSE, KERNELS
from worker_proc.plan.product_timer import GemmKey
from worker_proc.plan.tuning import COPY_PAYS, MARGIN, SPARE_COPY_FRACTION, SWITCH_MARGIN
from worker_proc.quant.weight import COPY_BYTES_PER_WEIGHT


def choose_methods(timings: dict[GemmKey, list[dict[str, float]]], counts: dict[GemmKey, int],
                   nbytes: dict[GemmKey, int], kept: dict[GemmKey, int],
                   affordable: Callable[[int], bool]) -> dict[GemmKey, list[str]]:
    """Each key's method per bucket from its `timings` (seconds by method, bucket by bucket), `counts` sites and
    `nbytes` of weights of it, `kept` bytes of them their owners read as stored. Each layout set
    (`layout_options`: every layout the fastest methods read, then sets of dense layouts) whose extra bytes
    `affordable` allows is completed, where restricted, by the copies that pay for the weights their owners
    read themselves (`kept_copies`); of those, the one holding the fewest bytes (the earlier on a tie) whose
    steps' products are at most COPY_PAYS slower than the fastest one's (`steps_slowdown`). Where no set
    fits, the single layout that loses least."""
    options = layout_options({k: t for k, t in timings.items() if not kept[k]}, counts)  # fastest first
    fitting: list[tuple[int, int, float, dict[GemmKey, list[str]]]] = []  # (extra bytes, order, slowdown, methods)
    seen: set[tuple[tuple[str, ...], ...]] = set()
    for order, layouts in enumerate(options):
        chosen = methods_within(timings, kept, layouts)
        signature = tuple(tuple(chosen[k]) for k in timings)
        if signature in seen:  # another set of layouts the same methods read (e.g. dense ones no key reads)
            continue
        seen.add(signature)
        extra = sum(second_copy_bytes(k, p, counts[k], nbytes[k], kept[k]) for k, p in chosen.items())
        if extra and not affordable(extra):
            continue
        if layouts is not None:
            chosen, extra = kept_copies(timings, chosen, kept, counts, nbytes, extra, affordable)
        fitting.append((extra, order, steps_slowdown(timings, counts, chosen), chosen))
    if not fitting:
        singles = [o for o in options if o is not None and len(o) == 1]
        return methods_within(timings, kept, singles[0] if singles else None)
    fastest = min(f[2] for f in fitting)
    return min(f for f in fitting if f[2] <= fastest + COPY_PAYS)[3]


def steps_slowdown(timings: dict[GemmKey, list[dict[str, float]]], counts: dict[GemmKey, int],
                   chosen: dict[GemmKey, list[str]]) -> float:
    """How much slower the products of a step are under `chosen` than under the fastest method of each
    product, as a fraction, averaged over the row buckets (each bucket's products summed over every site);
    infinite where `chosen` runs a method that was not timed."""
    slowdowns = []
    for bucket in range(max((len(t) for t in timings.values()), default=0)):
        taken = fastest = 0.0
        for key, timed in timings.items():
            if bucket < len(timed) and timed[bucket]:  # a method not timed there (a reference) counts as endless
                taken += counts[key] * timed[bucket].get(chosen[key][bucket], math.inf)
                fastest += counts[key] * min(timed[bucket].values())
        if fastest > 0:
            slowdowns.append(taken / fastest - 1.0)
    return sum(slowdowns) / len(slowdowns) if slowdowns else 0.0


def fastest_method(timed: dict[str, float], storage: str = "dense") -> str:
    """The fastest method, `dense` unless another beats it by more than MARGIN (nothing measured: the
    storage's reference product)."""
    if not timed:
        return LINEAR_METHODS[storage].reference.name
    best = min(timed, key=lambda m: timed[m])
    if DENSE.name in timed and timed[DENSE.name] <= timed[best] * (1 + MARGIN):
        return DENSE.name
    return best


def methods_by_bucket(timed: list[dict[str, float]], storage: str = "dense") -> list[str]:
    """`fastest_method` of each bucket in turn, a bucket keeping the previous bucket's method while that is within
    SWITCH_MARGIN of its fastest."""
    out: list[str] = []
    for t in timed:
        chosen = fastest_method(t, storage)
        prev = out[-1] if out else None
        if prev is not None and chosen != DENSE.name and prev in t and t[prev] <= min(t.values()) * (1 + SWITCH_MARGIN):
            chosen = prev
        out.append(chosen)
    return out


def own_methods(timed: dict[str, float]) -> dict[str, float]:
    return {m: s for m, s in timed.items() if not KERNELS[m].reads_copy}


def second_copy_bytes(key: GemmKey, per_bucket: list[str], count: int, nbytes: int, kept: int = 0) -> int:
    """Bytes these methods hold beyond one copy of the key's weights: a dense weight read as it is and as
    each of `COPIES` its methods read (a site reading only copies drops its dense weight unless its owner
    reads it: `kept` bytes), or a quantized weight's copies (`COPY_BYTES_PER_WEIGHT` each; the values stay)."""
    if key.storage == "dense":
        storages = {KERNELS[m].storage for m in per_bucket}
        copies = len(storages & set(COPIES))
        if "dense" in storages:
            return nbytes * copies
        return nbytes * max(copies - 1, 0) + (kept if copies else 0)
    kinds = {KERNELS[m].quantized_copy for m in per_bucket} - {""}
    per_weight = sum(COPY_BYTES_PER_WEIGHT[kind] for kind in kinds)
    return math.ceil(count * key.out_features * key.in_features * per_weight)


Layouts = frozenset[str] | None
"""What the weights may be read as (None: whatever the fastest methods read). A set names the storages dense
weights may be read from and, as `quantized_layout(kind)`, the copies of quantized weights that may be kept
(none named: a quantized weight is read as stored); a weight its owner reads itself takes no copy in it."""


def quantized_layout(kind: str) -> str:
    """The name of a quantized weight's copy `kind` (worker_proc.quant.weight.QUANTIZED_COPIES) in `Layouts`."""
    return f"quantized {kind}"


def layout_options(timings: dict[GemmKey, list[dict[str, float]]], counts: dict[GemmKey, int]) -> list[Layouts]:
    """None, then every smaller set of layouts that serves every dense key's buckets (each set of dense layouts
    with each set of the quantized weights' copies timed): sets of more layouts before sets of fewer, each size
    ordered by the step time it loses (`layouts_loss`)."""
    names = ("dense", *COPIES)
    dense = {k: t for k, t in timings.items() if k.storage == "dense"}
    quantized = {k: t for k, t in timings.items() if k.storage != "dense"}
    kinds = sorted({KERNELS[m].quantized_copy for t in quantized.values() for b in t for m in b} - {""})
    copy_sets = [frozenset(quantized_layout(c) for i, c in enumerate(kinds) if mask >> i & 1)
                 for mask in range(2 ** len(kinds))]
    options: list[tuple[int, float, frozenset[str]]] = []
    for mask in range(1, 2 ** len(names) - 1):
        layouts = frozenset(n for i, n in enumerate(names) if mask >> i & 1)
        loss = sum(counts[k] * layouts_loss(t, layouts) for k, t in dense.items())
        if loss == float("inf"):
            continue
        for copies in copy_sets:
            both = layouts | copies
            options.append((-len(both), loss + sum(counts[k] * layouts_loss(t, both, k.storage)
                                                   for k, t in quantized.items()), both))
    return [None, *(o[2] for o in sorted(options, key=lambda o: (o[0], o[1], sorted(o[2]))))]


def timed_within(timed: dict[str, float], layouts: frozenset[str], storage: str = "dense") -> dict[str, float]:
    """The timings of the methods reading only `layouts` (see `Layouts`) of a weight stored as `storage`."""
    if storage == "dense":
        return {m: s for m, s in timed.items() if KERNELS[m].storage in layouts}
    return {m: s for m, s in timed.items()
            if not KERNELS[m].quantized_copy or quantized_layout(KERNELS[m].quantized_copy) in layouts}


def layouts_loss(timed: list[dict[str, float]], layouts: frozenset[str], storage: str = "dense") -> float:
    """How much slower, summed over the buckets, the fastest methods reading only these layouts of a weight
    stored as `storage` are than the fastest of all (inf: a bucket none of them serves)."""
    total = 0.0
    for t in timed:
        allowed = timed_within(t, layouts, storage)
        if t and not allowed:
            return float("inf")
        total += min(allowed.values()) / min(t.values()) if t else 1.0
    return total


def kept_copies(timings: dict[GemmKey, list[dict[str, float]]], chosen: dict[GemmKey, list[str]],
                 kept: dict[GemmKey, int], counts: dict[GemmKey, int], nbytes: dict[GemmKey, int], extra: int,
                 affordable: Callable[[int], bool]) -> tuple[dict[GemmKey, list[str]], int]:
    """`chosen` (dense layouts restricted, `extra` bytes of copies) with the weights their owners read
    themselves (the tied LM head's, read only as stored there) given the copies their fastest methods read,
    all of them or one, the set that loses least among those still affordable on top of `extra`; the key
    losing most as stored goes first. A copy of such a weight is a pure addition, so the restricted
    layouts are chosen without it and it takes only what room they leave."""
    out = dict(chosen)
    owned = [k for k in timings if kept[k] and k.storage == "dense"]
    as_stored = frozenset({"dense"})
    for key in sorted(owned, key=lambda k: -counts[k] * layouts_loss(timings[k], as_stored)):
        best = (layouts_loss(timings[key], as_stored), 0, out[key])
        for copies in (*(frozenset({c}) for c in COPIES), frozenset(COPIES)):  # fewer bytes first
            layouts = as_stored | copies
            per_bucket = methods_by_bucket([timed_within(t, layouts) for t in timings[key]])
            more = second_copy_bytes(key, per_bucket, counts[key], nbytes[key], kept[key])
            lost = layouts_loss(timings[key], layouts)
            if more and lost * (1 + COPY_PAYS) < best[0] and affordable(extra + more):
                best = (lost, more, per_bucket)
        out[key] = best[2]
        extra += best[1]
    return out, extra


def methods_within(timings: dict[GemmKey, list[dict[str, float]]], kept: dict[GemmKey, int],
                   layouts: Layouts) -> dict[GemmKey, list[str]]:
    """Each key's per-bucket methods reading only `layouts` (see `Layouts`); a dense weight its owner reads
    itself (`kept` bytes) is then read only as it is."""
    out = {}
    for key, timed in timings.items():
        if layouts is None:
            out[key] = methods_by_bucket(timed, key.storage)
        elif key.storage == "dense" and not kept[key]:
            out[key] = methods_by_bucket([timed_within(t, layouts) for t in timed])
        elif key.storage == "dense":
            out[key] = [fastest_method(own_methods(t), key.storage) for t in timed]
        else:
            out[key] = methods_by_bucket([timed_within(t, layouts, key.storage) for t in timed], key.storage)
    return out


def copy_affordable(nbytes: int, physical: int | None = None) -> bool:
    """Whether keeping `nbytes` more of weights costs at most SPARE_COPY_FRACTION of the host's memory
    (`physical` bytes; None: this host's)."""
    total = physical_memory_bytes() if physical is None else physical
    return 0 < nbytes <= total * SPARE_COPY_FRACTION
