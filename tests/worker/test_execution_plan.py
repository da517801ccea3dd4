"""The execution plan (worker_proc.plan.execution_plan, plan_cache, threads): it picks what measures
fastest, keeps `dense` and fewer threads against noise, keeps one weight copy where two do not fit,
round-trips through its cache (and a different key measures again), honours a pinned file, and the
runner runs each step on the plan's threads."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from shared.config import ServerArgs, builtin_model_dir
from shared.errors import ModelLoadError
from shared.messages import ForwardBatch, ReqSlice, SamplingParams
from worker_proc.host.threads import thread_options
from worker_proc.linear.kernels import GemmKernel
from worker_proc.linear.site import GemmSite
from worker_proc.model.layers import Linear
from worker_proc.plan import source as plan_cache
from worker_proc.plan.execution_plan import choose, instances_of, product_sites
from worker_proc.plan.kernel_set import KernelChoice
from worker_proc.plan.product_timer import GemmKey, ProductTimer
from worker_proc.plan.tuning import DEFAULT_STREAM_BYTES, HOPELESS, MEASURE_ATTEMPTS, ROW_BUCKETS
from worker_proc.runtime.config import WorkerConfig
from worker_proc.runtime.runner import ModelRunner

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
        gemv = 1.0 if rows <= 8 else 2.0
        packed = {0: 1.04, 1: 0.97}[odd] if rows <= 8 else 1.0
        seconds = {"dense": 5.0, "packed": packed, "split": gemv}.get(method.name)
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
    assert asked == [2 * copy]
    # pairs: tiled + packed lose 1.6x at one row; dense + packed 2x at 2-32 rows; dense + tiled 2x past 32
    two = choose(_instances(A), (1,), measure, lambda n: n <= copy)
    assert two.gemms[A].methods == ("tiled", "packed") and two.gemms[A].bounds == (32,)
    # alone: tiled serves no bucket past 64 rows; packed loses 2x at 1-32 rows, dense at every bucket past 1
    one = choose(_instances(A), (1,), measure, lambda n: False)
    assert one.gemms[A].methods == ("packed",)


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
        speed = {"w4a16": 1.0 * rows, "w8a8_over_int4": 2.5 + 0.1 * rows}.get(method.name)
        return {} if speed is None else {key: speed}

    def affordable(nbytes: int) -> bool:
        asked.append(nbytes)
        return True

    both = choose([(site, torch.empty(0))], (1,), measure, affordable)
    assert both.gemms[key].bounds == (2,) and both.gemms[key].methods == ("w4a16", "w8a8_over_int4")
    assert asked == [64 * 32]  # one byte per weight
    one = choose([(site, torch.empty(0))], (1,), measure, lambda n: False)
    assert one.gemms[key].methods == ("w4a16",)


def test_a_hopeless_method_is_timed_no_further() -> None:
    """A method many times slower than the fastest timed at a key (oneDNN's int8 product of a few rows on some
    CPUs) stops after its first product past the untimed one (streamed) or after the untimed one (warm), and is
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


@pytest.fixture(autouse=True)
def _quiet_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether these tests' plans are saved must not depend on what else the machine runs meanwhile."""
    monkeypatch.setattr(plan_cache, "cpu_busy_seconds", lambda: (0.0, 0.0))


def test_a_sibling_ranks_load_past_this_ranks_share_is_no_contention() -> None:
    """Two ranks of a 4-core node measure their plans at once on 2 threads each: the other rank keeping its
    2 cores busy takes none of this rank's, so the plan is kept; the same load against a rank measuring on
    every core, or on 3 of 4, is contention. Noise under a fifth of a core is never contention."""
    assert not plan_cache.contended(2.0, (1, 2), cores=4)
    assert plan_cache.contended(2.0, (1, 4), cores=4) and plan_cache.contended(2.0, (1, 3), cores=4)
    assert not plan_cache.contended(0.1, (1, 4), cores=4) and plan_cache.contended(0.3, (1, 4), cores=4)
    assert plan_cache.contended(1.0, (1,), cores=0)  # cores unknown: all load counts


def test_a_plan_measured_while_other_processes_ran_is_measured_again_and_never_saved(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    measured: list[int] = []
    real = plan_cache.measure_plan
    monkeypatch.setattr(plan_cache, "measure_plan", lambda *a: (measured.append(1), real(*a))[1])
    busy = iter([0.0, 1e6, 1e6, 1e6])  # others busy during the first measurement, idle during the second
    monkeypatch.setattr(plan_cache, "cpu_busy_seconds", lambda: (next(busy), 0.0))
    first = _runner(tmp_path, thread_options=(1,))
    assert len(measured) == 2 and "saved to" in first.plan.source
    always = iter(float(i) * 1e6 for i in range(100))
    monkeypatch.setattr(plan_cache, "cpu_busy_seconds", lambda: (next(always), 0.0))
    contended = _runner(tmp_path / "other", thread_options=(1,))
    assert len(measured) == 2 + MEASURE_ATTEMPTS and contended.plan.source == "measured"
    assert not list((tmp_path / "other").glob("plan-*.json"))


def _runner(tmp_path: Path, **kw: object) -> ModelRunner:
    return ModelRunner(builtin_model_dir(), WorkerConfig(kv_slots=512, state_slots=4, plan_cache_dir=tmp_path, **kw))


def test_the_cache_round_trips_and_a_new_key_measures_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    measured: list[tuple[int, ...]] = []
    real = plan_cache.measure_plan
    monkeypatch.setattr(plan_cache, "measure_plan",
                        lambda m, t, *rest: (measured.append(t), real(m, t, *rest))[1])
    first = _runner(tmp_path, thread_options=(1,))
    assert measured == [(1,)] and "saved to" in first.plan.source
    again = _runner(tmp_path, thread_options=(1,))
    assert measured == [(1,)] and again.plan.source.startswith("cached")
    assert again.plan.gemms == first.plan.gemms and again.plan.threads == first.plan.threads
    other = {**plan_cache.cpu_identity(), "cpu": "another CPU"}
    monkeypatch.setattr(plan_cache, "cpu_identity", lambda: other)
    _runner(tmp_path, thread_options=(1,))
    assert len(measured) == 2 and len(list(tmp_path.glob("plan-*.json"))) == 2
    first.check_integrity()


class _DenseThenPacked:
    """A ProductTimer stand-in: `dense` fastest for one row, `packed` for more (so a plan that may keep
    two copies of a weight does)."""

    made: list[int] = []  # each timer's max_stream_bytes
    own_only: list[frozenset[GemmKey]] = []  # each timer's own_weights_only

    def __init__(self, instances: list[tuple[GemmSite, torch.Tensor]], cache_bytes: int, reps: int = 3,
                 max_stream_bytes: int = 0, own_weights_only: frozenset[GemmKey] = frozenset(),
                 load_blocks_mapped: bool = False) -> None:
        self.sites = [site for site, _ in instances]
        self.made.append(max_stream_bytes)
        self.own_only.append(own_weights_only)

    def __call__(self, method: GemmKernel, rows: int, threads: int) -> dict[GemmKey, float]:
        fast = "dense" if rows == 1 else "packed"
        return {GemmKey.of(s): 0.5 if method.name == fast else 1.0 for s in self.sites
                if method.supports(s, torch.device("cpu"))}

    def release(self) -> None:
        pass


def test_a_single_weight_copy_keeps_one_layout_of_every_weight(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plan_cache, "ProductTimer", _DenseThenPacked)
    both = _runner(tmp_path, thread_options=(1,))
    assert any(site.storages == {"dense", "packed"} for _, site, _ in product_sites(both.model))
    one = _runner(tmp_path, thread_options=(1,), single_weight_copy=True)
    assert "saved to" in one.plan.source and len(list(tmp_path.glob("plan-*.json"))) == 2  # its own cache key
    assert _DenseThenPacked.made[-2:] == [0, DEFAULT_STREAM_BYTES]  # its timing copies are bounded too
    tied = [site for _, site, _ in product_sites(one.model) if site.dense_kept]
    assert len(tied) == 1 and tied[0].storages == {"dense"}  # the embedding reads the dense table anyway
    assert _DenseThenPacked.own_only[-2:] == [frozenset(), frozenset({GemmKey.of(tied[0])})]  # no copy timed
    for owner, site, weight in product_sites(one.model):
        assert len(site.storages) == 1, site.storages
        assert site.storages == ({"dense"} if site.dense_kept else {"packed"})  # the layout that loses least
        if site.storages == {"packed"}:
            assert isinstance(owner, Linear) and weight.numel() == 0  # the dense weight is gone, not only unused
    one.check_integrity()
    greedy = SamplingParams(temperature=0.0)
    ids = [5, 9, 2, 7, 1, 3, 8, 4]
    for runner in (both, one):
        req = ReqSlice(rid="a", input_ids=ids, start_pos=0, kv_slots=list(range(1, 9)), state_slot=1, sample=True,
                       sampling=greedy, output_len=0)
        runner.step(ForwardBatch(step=1, reqs=[req], clears=[1]))
    assert one.plan.gemms.keys() == both.plan.gemms.keys()


def _write_plan(path: Path, runner: ModelRunner, method: str, threads: list[list[int]]) -> None:
    data = plan_cache.plan_to_json(runner.plan)
    for g in data["gemms"]:  # type: ignore[union-attr]
        g["bounds"], g["methods"] = [], [method]
    data["threads"] = threads
    path.write_text(json.dumps(data))


def test_a_pinned_plan_is_honoured_and_runs_each_step_on_its_threads(tmp_path: Path) -> None:
    base = _runner(tmp_path, thread_options=(1,))
    pinned = tmp_path / "pinned.json"
    _write_plan(pinned, base, "split", [[8, 1], [256, 2]])
    runner = _runner(tmp_path, thread_options=(1, 2), execution_plan=str(pinned))
    assert runner.plan.source == f"pinned {pinned}"
    assert all(site.methods[0].name == "split" for _, site, _ in product_sites(runner.model))
    seen: list[int] = []
    forward = runner.model.forward_step
    runner.model.forward_step = lambda *a, **k: (seen.append(torch.get_num_threads()), forward(*a, **k))[1]
    before = torch.get_num_threads()
    greedy = SamplingParams(temperature=0.0)
    try:
        n = 300
        prompt = ReqSlice(rid="a", input_ids=[3] * n, start_pos=0, kv_slots=list(range(1, n + 1)), state_slot=1,
                          sample=True, sampling=greedy, output_len=0)  # fmt: skip
        tok = runner.step(ForwardBatch(step=1, reqs=[prompt], clears=[1])).next_tokens["a"]
        decode = ReqSlice(rid="a", input_ids=[tok], start_pos=n, kv_slots=list(range(1, n + 2)), state_slot=1,
                          sample=True, sampling=greedy, output_len=1)  # fmt: skip
        runner.step(ForwardBatch(step=2, reqs=[decode]))
    finally:
        torch.set_num_threads(before)
    assert seen == [2, 1]


def test_a_pinned_plan_that_does_not_fit_is_refused(tmp_path: Path) -> None:
    base = _runner(tmp_path, thread_options=(1,))
    pinned = tmp_path / "pinned.json"
    data = plan_cache.plan_to_json(base.plan)
    data["gemms"] = data["gemms"][1:]  # type: ignore[index]
    pinned.write_text(json.dumps(data))
    with pytest.raises(ModelLoadError, match="has no rule for"):
        _runner(tmp_path, execution_plan=str(pinned))
    pinned.write_text('{"version": 1, "gemms": [{"out": "x"}]}')
    with pytest.raises(ModelLoadError, match="malformed"):
        _runner(tmp_path, execution_plan=str(pinned))
    with pytest.raises(ModelLoadError, match="No such file"):
        _runner(tmp_path, execution_plan=str(tmp_path / "absent.json"))


def test_the_deterministic_mode_pads_every_product(tmp_path: Path) -> None:
    runner = _runner(tmp_path, deterministic=True, thread_options=(2,))
    sites = [site for _, site, _ in product_sites(runner.model)]
    assert sites and all(site.batch_invariant for site in sites)
    assert runner.plan.threads == ((1, 2),) and not list(tmp_path.glob("plan-*.json"))
    assert len(instances_of(runner.model)) == len(sites)


def test_the_plan_names_the_kernels_it_runs(tmp_path: Path) -> None:
    """The mixers' kernel set is the plan's: the ops the runner uses are the ones its plan names and
    logs, in each mode; a kernel set that cannot serve the mode is refused before the weights load."""
    det = _runner(tmp_path, deterministic=True, thread_options=(1,))
    fast = _runner(tmp_path, thread_options=(1,))
    assert det.plan.kernels == KernelChoice("reference", True, "")  # the built-in model has no GDN layers
    assert fast.plan.kernels == KernelChoice("native", False, "")  # the fused CPU kernels build here
    for runner in (det, fast):
        assert runner.plan.kernels is not None and runner.ops.name == runner.plan.kernels.ops
        assert runner.ops.batch_invariant == runner.plan.kernels.batch_invariant
        assert next(iter(runner.plan.describe())).startswith(f"kernels: {runner.ops.name} (")
    with pytest.raises(ValueError, match="cannot serve --enable-deterministic-inference"):
        _runner(tmp_path, deterministic=True, kernels="fast")


def test_ranks_share_the_node_cores_and_never_oversubscribe() -> None:
    assert thread_options(ServerArgs(), cores=2) == (1, 2)
    assert thread_options(ServerArgs(), cores=16) == (1, 16)
    assert thread_options(ServerArgs(tp_size=2), cores=2) == (1,)
    assert thread_options(ServerArgs(tp_size=4), cores=16) == (1, 4)
    two_nodes = ServerArgs(tp_size=4, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:29500")
    assert thread_options(two_nodes, cores=8) == (1, 4)  # two ranks on this node
    assert thread_options(ServerArgs(dp_size=2, tp_size=2), cores=16) == (1, 4)
    assert thread_options(ServerArgs(cpu_threads=3), cores=16) == (3,)
    assert thread_options(ServerArgs(enable_deterministic_inference=True), cores=16) == (16,)


def test_the_mixer_timer_times_a_models_mamba_kernels_and_the_key_names_the_kernel_set() -> None:
    from worker_proc.kernels import FastOps
    from worker_proc.plan.mixer_timer import MixerTimer

    runner = ModelRunner(builtin_model_dir(),
        WorkerConfig(kv_slots=64, state_slots=2, plan_cache_dir=None, thread_options=(1,)))
    timer = MixerTimer(runner.model, runner.ops, reps=1)
    assert timer.layers == len(runner.cfg.mamba_layer_ids) > 0
    assert timer(1, 1) > 0 and timer(64, 1) > 0  # a decode of one request, a prefill of 64 tokens
    assert MixerTimer(torch.nn.Linear(2, 2), FastOps())(64, 1) == 0.0
    key = plan_cache.plan_key
    assert key(runner.model, "throughput", (1, 2), 2, "fast") != key(runner.model, "throughput", (1, 2), 2, "native")


def test_a_new_build_of_the_fused_kernels_is_measured_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan times the fused kernels (gemv among the product methods): a plan cached before their
    source changed does not stand for the new build."""
    from worker_proc.kernels import native

    if not native.load():
        pytest.skip("the fused CPU kernels cannot be built here")
    model = ModelRunner(
        builtin_model_dir(), WorkerConfig(kv_slots=64, state_slots=2, plan_cache_dir=None, thread_options=(1,))
    ).model
    before = plan_cache.plan_key(model, "throughput", (1,), 2, "native")
    monkeypatch.setattr(native, "build_digest", lambda: "another-build")
    assert plan_cache.plan_key(model, "throughput", (1,), 2, "native") != before


def test_a_plan_timed_under_another_allocator_policy_is_measured_again() -> None:
    """A worker times its products under the steps' allocator policy (`load_blocks_mapped`); a plan timed
    under a process's own policy (where temporaries may be fresh mappings on every call) does not stand for
    it."""
    model = ModelRunner(
        builtin_model_dir(), WorkerConfig(kv_slots=64, state_slots=2, plan_cache_dir=None, thread_options=(1,))
    ).model
    own = plan_cache.plan_key(model, "throughput", (1,), 2, "native")
    assert plan_cache.plan_key(model, "throughput", (1,), 2, "native", load_blocks_mapped=True) != own


class _TiledFastest(_DenseThenPacked):
    """A ProductTimer stand-in under which `tiled` is fastest at every row count it serves, `dense` beyond."""

    def __call__(self, method: GemmKernel, rows: int, threads: int) -> dict[GemmKey, float]:
        fast = "tiled" if rows <= 64 else "dense"
        return {
            GemmKey.of(s): 0.5 if method.name == fast else 1.0
            for s in self.sites
            if method.supports(s, torch.device("cpu"))
        }


def test_an_expert_stack_of_a_linears_shape_reads_no_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rule is per weight shape, and an expert stack shares a shape with a Linear: the Linear's sites read
    the tiled copy, the stack (whose copy would hold one expert only) the best method of its own weight."""
    from tests.worker.util import fixture_dir

    monkeypatch.setattr(plan_cache, "ProductTimer", _TiledFastest)
    r = ModelRunner(
        fixture_dir("rope_moe"), WorkerConfig(kv_slots=96, state_slots=4, plan_cache_dir=tmp_path, thread_options=(1,))
    )
    sites = [site for _, site, _ in product_sites(r.model)]
    shared = {site.shape for site in sites if not site.packable} & {site.shape for site in sites if site.packable}
    assert shared, "the fixture no longer has an expert stack of a Linear's shape"
    for site in sites:
        if site.shape in shared:
            assert ("tiled" in site.storages) == site.packable, (site.shape, site.storages)
    r.check_integrity()


class _TiledInt8Fastest(_DenseThenPacked):
    """A ProductTimer stand-in under which the tiled int8 product is fastest at every row count."""

    def __call__(self, method: GemmKernel, rows: int, threads: int) -> dict[GemmKey, float]:
        return {
            GemmKey.of(s): 0.5 if method.name == "tiled_w8a8" else 1.0
            for s in self.sites
            if method.supports(s, torch.device("cpu"))
        }


def test_a_quantized_expert_stack_of_a_linears_shape_reads_no_int8_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An int8 Linear's rule may read a tiled int8 copy; an int8 expert stack of its shape cannot hold one and
    takes the best method over its own values."""
    from tests.worker.util import fixture_dir
    from worker_proc.kernels import native

    if not native.load():
        pytest.skip("the fused CPU kernels cannot be built here")
    monkeypatch.setattr(plan_cache, "ProductTimer", _TiledInt8Fastest)
    r = ModelRunner(
        fixture_dir("rope_moe"),
        WorkerConfig(kv_slots=96, state_slots=4, plan_cache_dir=tmp_path, thread_options=(1,), quantization="int8"),
    )
    sites = [site for _, site, _ in product_sites(r.model) if site.quantized is not None]
    shared = {site.shape for site in sites if not site.packable} & {site.shape for site in sites if site.packable}
    assert shared, "the fixture no longer has an int8 expert stack of an int8 Linear's shape"
    for site in sites:
        q = site.quantized
        assert q is not None and (q.tiled is not None) == site.packable, site.shape
        assert all(bool(m.quantized_copy) == site.packable for m in site.methods), (site.shape, site.methods)
    r.check_integrity()


def test_each_int8_copy_of_a_quantized_weight_counts() -> None:
    """A quantized weight read through oneDNN's packed int8 copy at some rows and the tiled one at others holds
    both: two more bytes per weight."""
    from worker_proc.loading.quantize import quantize_weight

    site = GemmSite(64, 32, torch.float32, True)
    site.quantize(quantize_weight(torch.randn(64, 32), "int4"))
    key = GemmKey.of(site)
    asked: list[int] = []

    def measure(method: GemmKernel, rows: int, threads: int) -> dict[GemmKey, float]:
        speed = {
            "w4a16": 1.0 * rows,
            "w8a8_over_int4": 0.5 * rows if rows <= 8 else 99.0,
            "tiled_over_int4": 2.0 + 0.1 * rows,
        }.get(method.name)
        return {} if speed is None else {key: speed}

    def affordable(nbytes: int) -> bool:
        asked.append(nbytes)
        return True

    plan = choose([(site, torch.empty(0))], (1,), measure, affordable)
    assert plan.gemms[key].methods == ("w8a8_over_int4", "tiled_over_int4")
    assert asked == [2 * 64 * 32]
