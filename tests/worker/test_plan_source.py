"""Where a rank's execution plan comes from (worker_proc.plan.source): measured on a quiet CPU only, cached by
everything its timings depend on, pinned from a file; and the plan a runner binds (threads, kernels, copies
of expert stacks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shared.config import ServerArgs, builtin_model_dir
from shared.errors import ModelLoadError
from shared.messages import ForwardBatch, ReqSlice, SamplingParams
from worker_proc.host.threads import thread_options
from worker_proc.linear.kernels import TILED, GemmKernel
from worker_proc.linear.site import GemmSite
from worker_proc.model.layers import Linear
from worker_proc.plan import source as plan_cache
from worker_proc.plan.execution_plan import instances_of, product_sites
from worker_proc.plan.kernel_set import KernelChoice
from worker_proc.plan.product_timer import GemmKey
from worker_proc.plan.tuning import DEFAULT_STREAM_BYTES, MEASURE_ATTEMPTS
from worker_proc.runtime.config import WorkerConfig
from worker_proc.runtime.runner import ModelRunner

A = GemmKey(64, 32, "float32")
B = GemmKey(16, 32, "float32")


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
                 max_stream_bytes: int = 0, own_weights_only: frozenset[GemmKey] = frozenset()) -> None:
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


def test_a_plan_chosen_under_other_tuning_constants_or_kernel_limits_is_measured_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The constants that turn timings into rules, and the row counts each kernel is offered for, are part of
    a cached plan's key: a plan chosen under other values does not stand for this code's choice."""
    model = ModelRunner(
        builtin_model_dir(), WorkerConfig(kv_slots=64, state_slots=2, plan_cache_dir=None, thread_options=(1,))
    ).model
    own = plan_cache.plan_key(model, "throughput", (1,), 2, "native")
    assert own["methods"]["tiled"] == TILED.max_rows
    monkeypatch.setattr(plan_cache, "COPY_PAYS", 0.5)
    assert plan_cache.plan_key(model, "throughput", (1,), 2, "native") != own


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
