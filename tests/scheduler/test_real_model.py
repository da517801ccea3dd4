"""Scheduler + real in-process model runtime (CPU tensors, no stubs), over the built-in tiny
checkpoint (GraniteMoeHybrid: Mamba2 state), a tiny Gated DeltaNet checkpoint (the Qwen3.5 dense
parity fixture: conv + [heads, k_dim, v_dim] recurrent state), a tiny LFM2 checkpoint built by
transformers (short convolutions: the conv window is the whole state), a tiny Kimi Linear one (Kimi Delta
Attention's per-channel-decay state beside MLA's KV) and a tiny Mamba one (Mamba1: a conv window and a
[d_inner, d_state] state per layer, no attention): the scheduler, admission and radix cache are about states,
whatever the recurrent layer kind.

Greedy outputs must not depend on caching, chunking, batching, copy-on-write or retraction."""

from __future__ import annotations

import pytest

from scheduler_proc.drafting import DraftingGain
from scheduler_proc.scheduler import SchedulerTuning
from shared.config import builtin_model_dir
from shared.messages import GenerateReq
from shared.model_info import ModelInfo
from tests.scheduler import harness
from tests.scheduler.util import greq, make, rids, round_
from tests.worker.util import fixture_dir

torch = pytest.importorskip("torch")
runtime = pytest.importorskip("worker_proc.runtime.runner")
from worker_proc.runtime.config import WorkerConfig  # noqa: E402

KV_SLOTS, MAMBA_SLOTS = 256, 3


class AlwaysDraft(DraftingGain):
    def wants(self, n_decode: int) -> bool:
        return True


@pytest.fixture(scope="module", params=["builtin", "qwen3_5_dense", "lfm2_bias", "kimi_moe", "mamba_bias"])
def model_dir(request: pytest.FixtureRequest) -> str:
    if request.param == "builtin":
        return builtin_model_dir()
    if request.param.startswith("lfm2"):
        from tests.fixtures.lfm2_model import lfm2_dir  # builds it with transformers (torch)

        return lfm2_dir(request.param)
    if request.param.startswith("kimi"):
        from tests.fixtures.kimi_linear_model import kimi_dir  # builds it with transformers (torch)

        return kimi_dir(request.param)
    if request.param.startswith("mamba"):
        from tests.fixtures.mamba1_model import mamba1_dir  # builds it with transformers (torch)

        return mamba1_dir(request.param)
    return fixture_dir(request.param)


@pytest.fixture(scope="module")
def runner(model_dir: str) -> object:
    torch.manual_seed(0)
    return runtime.ModelRunner(model_dir, WorkerConfig(kv_slots=KV_SLOTS, state_slots=MAMBA_SLOTS, deterministic=True))


@pytest.fixture(scope="module")
def model(model_dir: str) -> ModelInfo:
    return ModelInfo.from_dir(model_dir)


def reference(runner: object, model: ModelInfo, reqs: list[GenerateReq], **args: object) -> dict[str, list[int]]:
    """The same requests with the radix cache disabled, batched together (the CPU path is batch-invariant)."""
    sched, _ = make(kv=KV_SLOTS, states=MAMBA_SLOTS, model=model, disable_radix_cache=True, **args)
    return harness.run(sched, runner, {0: reqs}).tokens  # type: ignore[arg-type]


def test_real_capacity_recovery(runner: object, model: ModelInfo) -> None:
    """Every state slot is taken (two running requests + the cached state the queued prompt hits); the
    queued request is refused; a running request finishes and donates its state; the queued request
    is admitted in the very next round, its copy-on-write succeeds and its output matches."""
    sched, _ = make(kv=KV_SLOTS, states=MAMBA_SLOTS, model=model, chunked_prefill_size=64,
                    disable_prompt_checkpoint=True)
    donor = harness.run(sched, runner, {0: [greq("donor", list(range(10, 22)), 3)]})  # type: ignore[arg-type]
    assert sched.cache.states_total == 1
    sched.add_request(greq("a", [30, 31, 32, 33], 5))
    sched.add_request(greq("c", [40, 41, 42], 12))
    round_(sched, runner)  # type: ignore[arg-type]
    assert sched.info().server.state_free == 0
    hit = list(range(10, 22)) + donor.tokens["donor"][:2] + [77]
    sched.add_request(greq("b", hit, 4))
    finished_round = admitted_round = -1
    b_batch = None
    b_tokens: list[int] = []
    for rnd in range(1, 40):
        batch, outs = round_(sched, runner)  # type: ignore[arg-type]
        b_tokens += [t for o in outs if o.rid == "b" for t in o.token_ids]
        if "b" in rids(batch) and admitted_round < 0:
            admitted_round, b_batch = rnd, batch
        if any(o.rid == "a" and o.finished for o in outs):
            finished_round = rnd
        if not sched.has_work:
            break
        if finished_round < 0:
            assert "b" not in rids(batch)
    assert sched.metrics.get("hyssm_admission_refusals_total", reason="mamba_state") >= 1
    assert admitted_round == finished_round + 1
    assert b_batch is not None and [op.rid for op in b_batch.copies] == ["b"]
    assert sched.metrics.get("hyssm_admission_refusals_total", reason="cow_alloc") == 0
    assert sched.cache.num_locked_nodes == 0
    assert b_tokens == reference(runner, model, [greq("b", hit, 4)])["b"]


def test_real_outputs_identical_with_cache_chunks_and_pressure(runner: object, model: ModelInfo) -> None:
    system = [(7 * i + 3) % 250 for i in range(40)]
    reqs = [greq(f"s{i}", system + [200 + i, 5, 6, 7, 8, 9], 4) for i in range(4)]
    ref = reference(runner, model, reqs)
    sched, _ = make(kv=KV_SLOTS, states=MAMBA_SLOTS, model=model, chunked_prefill_size=16, max_prefill_tokens=32)
    cached = []
    for r in reqs:  # one after another: the second checkpoints the branch point, the third hits it
        log = harness.run(sched, runner, {0: [r]})  # type: ignore[arg-type]
        assert log.tokens[r.rid] == ref[r.rid]
        cached.append(log.finals[r.rid].cached_tokens)
    assert cached[0] == 0 and all(c == len(system) for c in cached[2:]), cached
    # everything at once on tiny pools: refusals and retractions, same outputs
    sched, _ = make(kv=50, states=MAMBA_SLOTS, model=model, chunked_prefill_size=16, max_prefill_tokens=32,
                    tuning=SchedulerTuning(init_ratio=0.0, min_ratio=0.0))  # fmt: skip
    pressure = [greq(f"p{i}", system[: 20 + 4 * i] + [210 + i], 10) for i in range(4)]
    ref = reference(runner, model, pressure)
    log = harness.run(sched, runner, {0: pressure})  # type: ignore[arg-type]
    assert log.tokens == ref
    m = sched.metrics
    assert m.get("hyssm_admission_refusals_total", reason="kv") > 0
    assert m.get("hyssm_retractions_total", cause="kv") > 0 and m.get("hyssm_checkpoints_total", result="saved") > 0


def test_real_outputs_identical_with_drafts(model_dir: str, model: ModelInfo) -> None:
    """NGRAM speculation on the real model: greedy outputs equal those without it (bitwise numerics
    in this mode), with chunked prefill, a prefix hit and drafts rejected as well as accepted."""
    runner = runtime.ModelRunner(model_dir, WorkerConfig(kv_slots=KV_SLOTS, state_slots=8, deterministic=True))
    phrase = [(11 * i + 5) % 240 + 3 for i in range(12)]
    reqs = [greq("a", phrase * 3, 24), greq("b", phrase * 2 + [7, 8], 20)]
    sched, _ = make(kv=KV_SLOTS, states=8, model=model, disable_radix_cache=True)
    ref = harness.run(sched, runner, {0: reqs}).tokens  # type: ignore[arg-type]
    sched, _ = make(kv=KV_SLOTS, states=8, model=model, chunked_prefill_size=16,
                    speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)  # fmt: skip
    sched.speculation.gain = AlwaysDraft()  # whether drafting pays on this machine is not the question here
    log = harness.run(sched, runner, {0: reqs[:1], 3: reqs[1:]})  # type: ignore[arg-type]
    assert log.tokens == ref
    m = sched.metrics
    steps, drafted = m.get("hyssm_spec_verify_steps_total"), m.get("hyssm_spec_draft_tokens_total")
    assert steps > 0 and m.get("hyssm_spec_accepted_tokens_total") < drafted
    if model_dir == builtin_model_dir():  # the trained model continues a repeated phrase: drafts hit
        assert m.get("hyssm_spec_accepted_tokens_total") > 0
    again = harness.run(sched, runner, {0: [greq("c", phrase * 3, 24)]})  # type: ignore[arg-type]
    assert again.tokens["c"] == ref["a"] and again.finals["c"].cached_tokens > 0
