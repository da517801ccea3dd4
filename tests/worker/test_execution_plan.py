"""How the execution plan chooses (worker_proc.plan.execution_plan, method_choice, product_timer): it picks
what measures fastest, keeps `dense` and fewer threads against noise, keeps one weight copy where two do not
fit, and times each candidate as a step meets it (test_plan_source.py: where a plan comes from)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from worker_proc.linear.kernels import GemmKernel
from worker_proc.linear.site import GemmSite
from worker_proc.plan.execution_plan import choose
from worker_proc.plan.product_timer import GemmKey, ProductTimer
from worker_proc.plan.tuning import HOPELESS, ROW_BUCKETS
from worker_proc.quant.weight import COPY_BYTES_PER_WEIGHT

A = GemmKey(64, 32, "float32")
B = GemmKey(16, 32, "float32")


def _instances(*keys: GemmKey) -> list[tuple[GemmSite, torch.Tensor]]:
    return [(GemmSite(k.out_features, k.in_features, torch.float32, True), torch.zeros(k.out_features, k.in_features))
            for k in keys]


def _fake(speeds: dict[tuple[str, int], float], keys: tuple[GemmKey, ...] = (A, B)):
    """A measure whose seconds per product are `speeds[(method, threads)]` (scaled by rows), 1.0 if absent."""
    calls: list[tuple[str, int, int]] = []

    def measure(method: GemmKernel, rows: int, threads: int) -> dict[GemmKey, float]:
        calls.append((method.name, rows, threads))
        return {k: speeds.get((method.name, threads), 1.0) * rows for k in keys}

    return measure, calls


def test_the_faster_of_two_candidates_is_chosen() -> None:
    measure, calls = _fake({("dense", 1): 1.0, ("split", 1): 0.5, ("packed", 1): 2.0})
    plan = choose(_instances(A, B), (1,), measure, lambda n: True)
    assert plan.gemms[A].methods == ("split",) and plan.gemms[A].bounds == ()
    assert {rows for _, rows, _ in calls} == set(ROW_BUCKETS)
    measure, _ = _fake({("dense", 1): 1.0, ("split", 1): 2.0, ("packed", 1): 0.5})
    assert choose(_instances(A), (1,), measure, lambda n: True).gemms[A].methods == ("packed",)


def test_dense_and_fewer_threads_win_within_the_margin() -> None:
    measure, _ = _fake({("dense", 1): 1.0, ("split", 1): 0.99, ("packed", 1): 0.985, ("dense", 2): 0.99})
    plan = choose(_instances(A), (1, 2), measure, lambda n: True)
    assert plan.gemms[A].methods == ("dense",) and plan.threads == ((ROW_BUCKETS[-1], 1),)
    measure, _ = _fake({("dense", 2): 0.5})
    assert choose(_instances(A), (1, 2), measure, lambda n: True).threads == ((ROW_BUCKETS[-1], 2),)


def test_a_rule_does_not_flip_between_methods_within_the_noise() -> None:
    """Two methods within a few percent of each other trade places from bucket to bucket: the rule keeps
    the first one; a method that is clearly faster at larger products still takes over there."""
    def measure(method: GemmKernel, rows: int, threads: int) -> dict[GemmKey, float]:
        odd = ROW_BUCKETS.index(rows) % 2
        split = 1.0 if rows <= 8 else 2.0
        gemv = {0: 1.04, 1: 0.97}[odd] if rows <= 8 else 2.0
        packed = 5.0 if rows <= 8 else 1.0
        seconds = {"dense": 5.0, "packed": packed, "split": split, "gemv": gemv}.get(method.name)
        return {A: seconds} if seconds is not None else {}

    plan = choose(_instances(A), (1,), measure, lambda n: True)
    assert plan.gemms[A].methods == ("split", "packed") and plan.gemms[A].bounds == (8,)

    def by_threads(method: GemmKernel, rows: int, threads: int) -> dict[GemmKey, float]:
        odd = ROW_BUCKETS.index(rows) % 2
        one = {0: 1.04, 1: 0.96}[odd] if rows <= 64 else 2.0
        return {A: one if threads == 1 else 1.0} if method.name == "dense" else {}

    assert choose(_instances(A), (1, 2), by_threads, lambda n: True).threads == ((ROW_BUCKETS[-1], 2),)


def test_a_burst_during_one_round_does_not_decide_a_choice() -> None:
    """Two threads are twice as fast, but whatever runs first at each row count is slowed tenfold (a
    sibling process starting): the rounds take turns and the fastest of each figure decides."""
    seen: set[tuple[int, int]] = set()

    def measure(method: GemmKernel, rows: int, threads: int) -> dict[GemmKey, float]:
        burst = (rows, threads) not in seen and threads == 2
        seen.add((rows, threads))
        return {A: rows / threads * (10.0 if burst else 1.0)} if method.name == "dense" else {}

    plan = choose(_instances(A), (1, 2), measure, lambda n: True)
    assert plan.threads == ((ROW_BUCKETS[-1], 2),)


def test_a_few_row_product_is_not_timed_against_prefill_steps() -> None:
    weight = torch.randn(64, 32)
    timer = ProductTimer([(GemmSite(64, 32, torch.float32, True), weight)], cache_bytes=1 << 20)
    few_rows = GemmKernel("few_rows", "dense", lambda x, w, stored, bias: x @ w.T, max_rows=8)
    assert A in timer(few_rows, 8, 1) and timer(few_rows, 9, 1) == {}


def test_a_site_timed_up_to_some_rows_keeps_that_choice_beyond_them() -> None:
    """An LM head is timed at decode batches only: its timer skips it above its rows, and the plan gives
    larger products the choice of the largest bucket timed (not the untimed default)."""
    head = GemmSite(64, 32, torch.float32, True, timed_rows=16)
    timer = ProductTimer([(head, torch.randn(64, 32))], cache_bytes=1 << 20)
    dense = GemmKernel("dense", "dense", lambda x, w, stored, bias: x @ w.T)
    assert A in timer(dense, 16, 1) and timer(dense, 17, 1) == {}

    def measure(method: GemmKernel, rows: int, threads: int) -> dict[GemmKey, float]:
        if rows > 16:
            return {}
        return {A: {"dense": 2.0, "split": 1.0}.get(method.name, 3.0) * rows}

    plan = choose(_instances(A), (1,), measure, lambda n: True)
    assert plan.gemms[A].methods == ("split",)


def test_a_steps_recurrent_kernels_count_in_its_thread_choice() -> None:
    """Products as fast on one thread as on two, but a prefill's scan twice as fast on two: steps above
    the decode buckets take two threads, decode steps (whose kernels gain nothing) keep one."""
    measure, _ = _fake({})
    mixers = lambda rows, threads: (10.0 * rows / threads if rows > 8 else 10.0 * rows)  # noqa: E731
    plan = choose(_instances(A), (1, 2), measure, lambda n: True, mixers)
    assert plan.threads == ((8, 1), (ROW_BUCKETS[-1], 2))
    assert choose(_instances(A), (1, 2), measure, lambda n: True).threads == ((ROW_BUCKETS[-1], 1),)


def test_rules_change_by_row_bucket_and_two_copies_need_the_memory() -> None:
    def measure(method: GemmKernel, rows: int, threads: int) -> dict[GemmKey, float]:
        fast = "split" if rows <= 4 else "packed"
        return {A: 0.5 if method.name == fast else 1.0}

    both = choose(_instances(A), (1,), measure, lambda n: True)
    assert both.gemms[A].bounds == (4,) and both.gemms[A].methods == ("split", "packed")
    # no room for a dense and a packed copy: the dense storage loses 2x in the four buckets above 4 rows,
    # the packed one 2x in the three up to 4 rows, so the packed copy alone is kept
    one = choose(_instances(A), (1,), measure, lambda n: False)
    assert one.gemms[A].bounds == () and one.gemms[A].methods == ("packed",)


def test_each_layout_of_a_weight_counts_as_a_copy() -> None:
    """A dense weight read as it is, tiled and packed is three copies of it, one read only tiled and packed two
    (the dense one is dropped). Where three do not fit, the two layouts that lose least are kept; where no two
    fit, the one layout that loses least."""
    def measure(method: GemmKernel, rows: int, threads: int) -> dict[GemmKey, float]:
        fast = "dense" if rows == 1 else ("tiled" if rows <= 32 else "packed")
        if method.name not in ("dense", "tiled", "packed") or method.name == "tiled" and rows > 64:
            return {}
        return {A: 0.5 if method.name == fast else (0.8 if method.name == "tiled" else 1.0)}

    copy = A.out_features * A.in_features * 4
    asked: list[int] = []
    three = choose(_instances(A), (1,), measure, lambda n: asked.append(n) or True)
    assert three.gemms[A].methods == ("dense", "tiled", "packed") and three.gemms[A].bounds == (1, 32)
    assert asked[0] == 2 * copy  # every layout the fastest methods read, asked first
    # pairs: tiled + packed lose 1.6x at one row; dense + packed 2x at 2-32 rows; dense + tiled 2x past 32
    two = choose(_instances(A), (1,), measure, lambda n: n <= copy)
    assert two.gemms[A].methods == ("tiled", "packed") and two.gemms[A].bounds == (32,)
    # alone: tiled serves no bucket past 64 rows; packed loses 2x at 1-32 rows, dense at every bucket past 1
    one = choose(_instances(A), (1,), measure, lambda n: False)
    assert one.gemms[A].methods == ("packed",)


def test_a_second_copy_is_kept_only_where_it_makes_the_steps_products_faster_by_more_than_copy_pays() -> None:
    """Memory affording it is not enough: a copy the fastest methods read is kept only where reading fewer
    layouts would make the steps' products more than COPY_PAYS slower. `tiled` serving every row count
    within a percent of `packed` leaves one copy of the weight (the dense one dropped); 30 % slower past 32
    rows, `packed` pays for its copy there."""
    from worker_proc.plan.tuning import COPY_PAYS

    def measure_with(tiled_large: float) -> Callable[[GemmKernel, int, int], dict[GemmKey, float]]:
        def measure(method: GemmKernel, rows: int, threads: int) -> dict[GemmKey, float]:
            seconds = {"dense": 1.0, "packed": 0.9 if rows <= 32 else 0.5,
                       "tiled": 0.5 if rows <= 32 else tiled_large}.get(method.name)
            return {A: seconds} if seconds is not None else {}
        return measure

    close = 0.5 * (1 + COPY_PAYS / 2)
    one = choose(_instances(A), (1,), measure_with(close), lambda n: True)
    assert one.gemms[A].methods == ("tiled",)
    two = choose(_instances(A), (1,), measure_with(0.65), lambda n: True)
    assert two.gemms[A].methods == ("tiled", "packed") and two.gemms[A].bounds == (32,)


def test_a_weight_its_owner_reads_gets_a_copy_in_the_room_the_layouts_leave() -> None:
    """A tied LM head keeps its dense weight for the embedding whatever the plan does, so a copy of it is a
    pure addition: the dense layouts are chosen first, then the head takes the copy its fastest methods
    read where that still fits (the one copy that loses least when both do not), and none where it does
    not."""
    head = GemmKey(128, 32, "float32")

    def measure(method: GemmKernel, rows: int, threads: int) -> dict[GemmKey, float]:
        fast = "dense" if rows == 1 else ("tiled" if rows <= 32 else "packed")
        if method.name not in ("dense", "tiled", "packed") or method.name == "tiled" and rows > 64:
            return {}
        return {k: 0.5 if method.name == fast else (0.8 if method.name == "tiled" else 1.0) for k in (A, head)}

    instances = _instances(A, head)
    instances[1][0].dense_kept = True
    copy_a, copy_head = A.out_features * A.in_features * 4, head.out_features * head.in_features * 4
    # A's pair (tiled + packed: one copy more than its weight) leaves room for one copy of the head only
    plan = choose(instances, (1,), measure, lambda n: n <= copy_a + copy_head)
    assert plan.gemms[A].methods == ("tiled", "packed")
    assert set(plan.gemms[head].methods) == {"dense", "tiled"}  # tiled loses 1.6x past 32 rows, packed 2x up to 32
    # room for both copies of the head: it reads every layout, as where all copies fit
    both = choose(instances, (1,), measure, lambda n: n <= copy_a + 2 * copy_head)
    assert both.gemms[head].methods == ("dense", "tiled", "packed")
    # no room beyond A's pair: the head is read as stored
    bare = choose(instances, (1,), measure, lambda n: n <= copy_a)
    assert bare.gemms[head].methods == ("dense",) and bare.gemms[A].methods == ("tiled", "packed")


def test_an_int4_weights_int8_copy_is_a_second_copy_that_needs_the_memory() -> None:
    """torch's 4-bit product costs one pass over the weight per row; the int8 copy's wins from 4 rows up
    when the memory for it is there, and is never made when it is not."""
    from worker_proc.loading.quantize import quantize_weight

    site = GemmSite(64, 32, torch.float32, True)
    site.quantize(quantize_weight(torch.randn(64, 32), "int4"))
    key = GemmKey.of(site)
    assert key.storage == "int4"
    asked: list[int] = []

    def measure(method: GemmKernel, rows: int, threads: int) -> dict[GemmKey, float]:
        speed = {"w4a16": 1.0 * rows, "tiled_over_int4": 2.5 + 0.1 * rows}.get(method.name)
        return {} if speed is None else {key: speed}

    def affordable(nbytes: int) -> bool:
        asked.append(nbytes)
        return True

    both = choose([(site, torch.empty(0))], (1,), measure, affordable)
    assert both.gemms[key].bounds == (2,) and both.gemms[key].methods == ("w4a16", "tiled_over_int4")
    assert asked == [64 * 32]  # one byte per weight
    one = choose([(site, torch.empty(0))], (1,), measure, lambda n: False)
    assert one.gemms[key].methods == ("w4a16",)


def test_a_hopeless_method_is_timed_no_further() -> None:
    """A method many times slower than the fastest timed at a key (a library product at row counts it has no
    fast path for) stops after its first product past the untimed one (streamed) or after the untimed one (warm), and is
    reported slower; a fast one is timed in full. Slower by more than HOPELESS squared, it is not timed at that
    key's larger row counts."""
    calls: dict[str, int] = {"fast": 0, "slow": 0}

    def product(name: str, busy_s: float) -> GemmKernel:
        def run(x: torch.Tensor, w: torch.Tensor, stored: object, bias: torch.Tensor | None) -> torch.Tensor:
            calls[name] += 1
            end = time.perf_counter() + busy_s
            while time.perf_counter() < end:  # a slow kernel: real time spent computing
                out = x @ w.T
            return out if busy_s else x @ w.T
        return GemmKernel(name, "dense", run)

    fast, slow = product("fast", 0.0), product("slow", 0.005)
    # streamed (2 rows): the three weights of A in an untimed and two timed rounds; warm (64): A's first weight
    for rows, fast_calls, slow_calls in ((2, 9, 2), (64, 3, 1)):
        timer = ProductTimer(_instances(A, A, A), cache_bytes=1 << 20, reps=2)
        calls.update(fast=0, slow=0)
        quick, late = timer(fast, rows, 1), timer(slow, rows, 1)
        assert calls["fast"] == fast_calls and calls["slow"] == slow_calls and late[A] > HOPELESS * quick[A]
        assert late[A] > HOPELESS * HOPELESS * quick[A]  # a 5 ms product against a few microseconds
        assert timer(slow, 2 * rows, 1) == {} and calls["slow"] == slow_calls
        assert A in timer(slow, 2 * rows, 2)  # another thread count is timed on its own


def test_the_real_timer_reports_every_supported_key() -> None:
    from worker_proc.linear.kernels import DENSE, PACKED

    timer = ProductTimer(_instances(A, B, A), cache_bytes=1 << 20, reps=2)
    for method in (DENSE, PACKED):
        got = timer(method, 2, 1)
        assert set(got) == {A, B} and all(s > 0 for s in got.values())
    assert len(timer.streamed) == 3 and len(timer.copies) == 3  # a packed copy of every weight streamed
    timer.release()
    capped = ProductTimer(_instances(A, B, A), cache_bytes=1 << 20, reps=2, max_stream_bytes=1)
    assert len(capped.streamed) == 2  # past the cap, only a first weight of a shape not yet streamed
    assert set(capped(PACKED, 2, 1)) == {A, B} and len(capped.copies) == 2


def test_a_shape_read_only_as_it_is_gets_no_timing_copy() -> None:
    """Under `--single-weight-copy` a shape whose dense weight its owner reads (the tied LM head's) is
    only ever read as it is: the timer makes no copy of it (one of the head would be its whole size
    again, twice, while the plan is measured) and still times the methods reading it as it is."""
    from worker_proc.linear.kernels import DENSE, PACKED, TILED

    timer = ProductTimer(_instances(A, B), cache_bytes=1 << 20, reps=1, own_weights_only=frozenset({A}))
    for method in (PACKED, TILED):
        assert set(timer(method, 2, 1)) == {B}
    assert {storage for storage, _ in timer.copies} == {"packed", "tiled"} and len(timer.copies) == 2
    assert set(timer(DENSE, 2, 1)) == {A, B}


def test_a_weight_larger_than_the_stream_budget_leaves_no_shape_untimed() -> None:
    """A model's LM head can alone exceed twice the last-level cache; every other shape is still
    timed at the streamed row counts (untimed, it would run `dense` there whatever is faster)."""
    from worker_proc.linear.kernels import DENSE

    head = GemmKey(4096, 64, "float32")
    timer = ProductTimer(_instances(head, A, B, A, B), cache_bytes=(4096 * 64 * 4) // 4, reps=1)
    assert [GemmKey.of(s) for s, _ in timer.streamed] == [head, A, B]
    got = timer(DENSE, 1, 1)
    assert set(got) == {head, A, B} and all(s > 0 for s in got.values())


def test_each_int8_copy_of_a_quantized_weight_counts() -> None:
    """A 4-bit weight read through its tiled 4-bit copy at some rows and the tiled int8 one at others holds both:
    their bytes per weight added."""
    from worker_proc.loading.quantize import quantize_weight

    site = GemmSite(64, 32, torch.float32, True)
    site.quantize(quantize_weight(torch.randn(64, 32), "int4"))
    key = GemmKey.of(site)
    asked: list[int] = []

    def measure(method: GemmKernel, rows: int, threads: int) -> dict[GemmKey, float]:
        speed = {
            "w4a16": 1.0 * rows,
            "tiled_w4a8": 0.5 * rows if rows <= 8 else 99.0,
            "tiled_over_int4": 2.0 + 0.1 * rows,
        }.get(method.name)
        return {} if speed is None else {key: speed}

    def affordable(nbytes: int) -> bool:
        asked.append(nbytes)
        return True

    plan = choose([(site, torch.empty(0))], (1,), measure, affordable)
    assert plan.gemms[key].methods == ("tiled_w4a8", "tiled_over_int4")
    # asked for both copies first; one of them alone loses more than COPY_PAYS, so both are kept
    assert asked[0] == math.ceil(64 * 32 * (COPY_BYTES_PER_WEIGHT["tiled"] + COPY_BYTES_PER_WEIGHT["tiled4"]))


def test_a_quantized_weight_keeps_only_the_copies_that_pay() -> None:
    """Of a 4-bit weight's two copies, the tiled int8 one that makes its products a few percent faster at
    some rows is not kept: the tiled 4-bit copy alone serves every row within COPY_PAYS."""
    from worker_proc.loading.quantize import quantize_weight

    site = GemmSite(64, 32, torch.float32, True)
    site.quantize(quantize_weight(torch.randn(64, 32), "int4"))
    key = GemmKey.of(site)

    def measure(method: GemmKernel, rows: int, threads: int) -> dict[GemmKey, float]:
        speed = {"w4a16": 1.0 * rows, "tiled_w4a8": 0.5 * rows,
                 "tiled_over_int4": 0.5 * rows * (0.99 if rows > 8 else 1.5)}.get(method.name)
        return {} if speed is None else {key: speed}

    plan = choose([(site, torch.empty(0))], (1,), measure, lambda n: True)
    assert plan.gemms[key].methods == ("tiled_w4a8",)
