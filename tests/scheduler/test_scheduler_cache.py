"""Prefix caching on a hybrid model (issue 5, scheduler side) with the checking fake worker: chunked
prefill, branch-point and periodic checkpoints, retraction with saved progress, O(1) retries."""

from __future__ import annotations

import random

import pytest

from scheduler_proc.radix_cache import PeekResult
from scheduler_proc.scheduler import Scheduler, SchedulerTuning
from shared.messages import GenerateReq
from shared.model_info import ModelInfo
from tests.scheduler import harness
from tests.scheduler.util import HYBRID, MAMBA_ONLY, greq, make, rids, round_


def test_chunked_prefill_runs_beside_decode_and_continues_first() -> None:
    sched, worker = make(chunked_prefill_size=64, max_prefill_tokens=64)
    sched.add_request(greq("short", [1, 2, 3], 10))
    round_(sched, worker)
    sched.add_request(greq("long", list(range(150)), 2))
    sched.add_request(greq("next", [9, 9, 9], 2))
    sizes = []
    for _ in range(3):
        batch, _ = round_(sched, worker)
        assert batch is not None and "short" in rids(batch)  # decode tokens ride along
        sizes.append({s.rid: len(s.input_ids) for s in batch.reqs})
    assert [s.get("long") for s in sizes] == [64, 64, 22]
    assert "next" not in sizes[0] and "next" not in sizes[1]  # the chunked request continues first
    assert sizes[2]["next"] == 3  # and the rest of the budget admits the next request
    harness.run(sched, worker, {})


def shared_prefix_requests(n: int, prefix_len: int, suffix_len: int, seed: int = 0) -> list[GenerateReq]:
    rng = random.Random(seed)
    system = [rng.randrange(1, 50) for _ in range(prefix_len)]
    out = []
    for i in range(n):
        suffix = [50 + i] + [rng.randrange(1, 50) for _ in range(suffix_len - 1)]  # distinct first token
        out.append(greq(f"r{i}", system + suffix, 6))
    return out


@pytest.mark.parametrize("model", [HYBRID, MAMBA_ONLY], ids=["hybrid", "mamba_only"])
@pytest.mark.parametrize("chunk", [32, 512])
def test_branch_point_checkpoint_makes_the_third_request_hit(chunk: int, model: ModelInfo) -> None:
    sched, worker = make(kv=2048, states=16, model=model, chunked_prefill_size=chunk, max_prefill_tokens=512,
                         disable_prompt_checkpoint=True)
    reqs = shared_prefix_requests(8, 300, 40)
    cached, ckpt_batches = [], 0
    for r in reqs:
        log = harness.run(sched, worker, {0: [r]}, keep_batches=True)
        cached.append(log.finals[r.rid].cached_tokens)
        ckpt_batches += sum(1 for b in log.batches if any(op.rid is None for op in b.copies))
    assert cached[0] == 0 and cached[1] == 0
    assert all(c == 300 for c in cached[2:]), cached
    assert ckpt_batches == 1 and sched.metrics.get("hyssm_checkpoints_total", result="saved") == 1
    ref_sched, ref_worker = make(kv=2048, states=16, model=model, disable_radix_cache=True)
    ref = harness.run(ref_sched, ref_worker, {0: reqs})
    for r in reqs:
        log = harness.run(sched, worker, {0: [greq(r.rid, r.input_ids, 6)]})
        assert log.tokens[r.rid] == ref.tokens[r.rid]


@pytest.mark.parametrize("chunk", [16, 512])
def test_prompt_end_checkpoint_makes_the_next_request_extending_the_prompt_hit(chunk: int) -> None:
    """A prompt's final state is saved (a copy in the next batch, before its first decode step), so the
    very next request that extends it resumes there; outputs equal a cache-off run. Without the
    checkpoint that request reuses only the KV and recomputes the whole prefix."""
    prefix = [(7 * i) % 45 + 1 for i in range(100)]
    later = greq("ext", prefix + [47, 48, 49], 5)
    ref_sched, ref_worker = make(kv=2048, states=16, disable_radix_cache=True)
    ref = harness.run(ref_sched, ref_worker, {0: [later]})
    for enabled in (True, False):
        sched, worker = make(kv=2048, states=16, chunked_prefill_size=chunk, disable_prompt_checkpoint=not enabled)
        first = harness.run(sched, worker, {0: [greq("first", prefix, 4)]}, keep_batches=True)
        ckpts = [op for b in first.batches for op in b.copies if op.rid is None]
        log = harness.run(sched, worker, {0: [greq("ext", later.input_ids, 5)]}, keep_batches=True)
        if enabled:
            assert len(ckpts) == 1  # and one more for the second prompt's own end:
            assert sched.metrics.get("hyssm_checkpoints_total", result="saved") == 2
            assert log.finals["ext"].cached_tokens == len(prefix)
            assert log.batches[0].reqs[0].start_pos == len(prefix)  # only the 3 new tokens computed
        else:
            assert not ckpts and log.batches[0].reqs[0].start_pos == 0
        assert log.tokens["ext"] == ref.tokens["ext"]
        sched.check_integrity()


def test_branch_split_is_exact_and_checkpoint_copies_in_the_next_batch() -> None:
    sched, worker = make(chunked_prefill_size=512)
    harness.run(sched, worker, {0: [greq("a", list(range(1, 21)), 2)]})
    sched.add_request(greq("b", list(range(1, 13)) + [40, 41, 42], 2))
    b1, _ = round_(sched, worker)
    assert b1 is not None and b1.reqs[0].start_pos == 0 and len(b1.reqs[0].input_ids) == 12
    assert not b1.reqs[0].sample and b1.clears == [b1.reqs[0].state_slot]
    b2, _ = round_(sched, worker)
    assert b2 is not None and [(op.src, op.rid) for op in b2.copies] == [(b1.reqs[0].state_slot, None)]
    assert b2.reqs[0].start_pos == 12
    assert sched.cache.peek(list(range(1, 13)) + [7], 12).prefix_len == 12


def test_multi_turn_hits_the_whole_previous_conversation() -> None:
    sched, worker = make(kv=1024, states=8, chunked_prefill_size=64)
    convo = list(range(1, 30))
    prev_len = 0
    for turn in range(4):
        log = harness.run(sched, worker, {0: [greq(f"t{turn}", convo, 8)]})
        if turn:
            assert log.finals[f"t{turn}"].cached_tokens >= prev_len, (turn, log.finals[f"t{turn}"])
        prev_len = len(convo) + len(log.tokens[f"t{turn}"]) - 1  # the last answer token has no KV yet
        convo = convo + log.tokens[f"t{turn}"] + [turn + 1, 7, 7]


def test_periodic_checkpoints() -> None:
    sched, worker = make(kv=1024, states=16, chunked_prefill_size=64, mamba_checkpoint_interval=50,
                         disable_prompt_checkpoint=True)
    prompt = list(range(1, 180))
    log = harness.run(sched, worker, {0: [greq("a", prompt, 2)]}, keep_batches=True)
    starts = [b.reqs[0].start_pos for b in log.batches if b.reqs[0].start_pos < len(prompt)]
    assert {50, 100, 150} <= set(starts)
    assert sched.metrics.get("hyssm_checkpoints_total", result="saved") == 3
    log = harness.run(sched, worker, {0: [greq("b", prompt[:120] + [3, 3], 2)]})
    assert log.finals["b"].cached_tokens == 100


def test_checkpoint_skipped_without_a_slot() -> None:
    sched, worker = make(disable_prompt_checkpoint=True, kv=512, states=1, chunked_prefill_size=512)
    harness.run(sched, worker, {0: [greq("a", list(range(1, 40)), 2)]})
    # the only state slot is the cached one; b's fresh slot evicts it, nothing is left for a checkpoint
    log = harness.run(sched, worker, {0: [greq("b", list(range(1, 20)) + [44, 45], 2)]})
    assert sched.metrics.get("hyssm_checkpoints_total", result="skipped") == 1
    assert log.finals["b"].finish_reason == "length"


def pressure_requests(n: int, seed: int) -> dict[int, list[GenerateReq]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.randrange(20, 60))] for _ in range(3)]
    arrivals: dict[int, list[GenerateReq]] = {}
    for i in range(n):
        prompt = rng.choice(prefixes) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 12))]
        arrivals.setdefault(rng.randrange(0, 12), []).append(greq(f"p{i}", prompt, rng.randrange(4, 40)))
    return arrivals


@pytest.mark.parametrize("model", [HYBRID, MAMBA_ONLY], ids=["hybrid", "mamba_only"])
def test_memory_pressure_outputs_identical_and_nothing_stuck(model: ModelInfo) -> None:
    """For a model without attention the KV pressure is a --max-total-tokens of 160 token slots."""
    arrivals = pressure_requests(32, seed=1)
    ref_sched, ref_worker = make(kv=8192, states=64, model=model, chunked_prefill_size=32, max_running_requests=64)
    ref = harness.run(ref_sched, ref_worker, arrivals)
    tuning = SchedulerTuning(init_ratio=0.2, min_ratio=0.05)
    sched, worker = make(kv=160, states=6, model=model, chunked_prefill_size=32, max_prefill_tokens=64,
                         max_running_requests=16, tuning=tuning)  # fmt: skip
    log = harness.run(sched, worker, arrivals, max_rounds=5000)
    assert log.tokens == ref.tokens
    m = sched.metrics
    assert m.get("hyssm_retractions_total", cause="kv") > 0
    assert m.get("hyssm_admission_refusals_total", reason="kv") + m.get(
        "hyssm_admission_refusals_total", reason="mamba_state"
    ) > 0
    assert m.get("hyssm_checkpoints_total", result="saved") > 0
    assert m.get("hyssm_prefix_cache_hit_tokens_total", kind="state") > 0
    assert sched.cache.num_locked_nodes == 0 and sched.cache.kv_evictable == sched.cache.kv_total
    assert sched.res.kv_alloc.num_free + sched.cache.kv_total == 160
    assert sched.res.state_alloc.num_free + sched.cache.states_total == 6


def test_kv_retraction_keeps_the_shared_prefix_state() -> None:
    """A KV retraction's own progress is what the others need (it is evicted at once), but it resumes
    from the state of its shared prefix: only its own part is recomputed."""
    shared = list(range(1, 41))
    tuning = SchedulerTuning(init_ratio=0.0, min_ratio=0.0)
    reqs = [greq(f"r{i}", shared + [41 + i, 41 + i], 30) for i in range(3)]
    sched, worker = make(kv=110, states=8, tuning=tuning)
    harness.run(sched, worker, {0: [greq("warm", shared + [99], 2)]})
    harness.run(sched, worker, {0: [greq("warm2", shared + [98], 2)]})  # checkpoints the branch point
    log = harness.run(sched, worker, {0: reqs})
    assert all(log.finals[r.rid].cached_tokens == len(shared) for r in reqs)
    m = sched.metrics
    retractions = m.get("hyssm_retractions_total", cause="kv")
    assert retractions >= 1
    recomputed, progress = m.get("hyssm_retract_recomputed_tokens_total"), m.get("hyssm_retracted_tokens_total")
    assert recomputed <= progress - retractions * len(shared)
    ref_sched, ref_worker = make(kv=4096, states=8)
    assert log.tokens == harness.run(ref_sched, ref_worker, {0: reqs}).tokens


def test_preempted_request_resumes_without_recomputation() -> None:
    sched, worker = make(kv=512, states=8, schedule_policy="priority", enable_priority_preemption=True,
                         max_running_requests=1)  # fmt: skip
    sched.add_request(greq("low", list(range(1, 30)), 20))
    for _ in range(5):
        round_(sched, worker)
    sched.add_request(greq("high", [7, 7, 7], 5, priority=3))
    log = harness.run(sched, worker, {})
    m = sched.metrics
    assert m.get("hyssm_retractions_total", cause="priority") == 1
    assert m.get("hyssm_retracted_tokens_total") == 29 + 4
    assert m.get("hyssm_retract_recomputed_tokens_total") == 0
    assert log.finals["low"].completion_tokens == 20


def test_retry_of_an_unchanged_request_does_not_walk_the_tree() -> None:
    sched, worker = make(disable_prompt_checkpoint=True, kv=1024, states=2)
    prompt = list(range(1, 200))
    first = harness.run(sched, worker, {0: [greq("seed", prompt, 3)]})
    sched.add_request(greq("runner", [7, 7, 7], 40))
    round_(sched, worker)
    # one slot is the runner's, one the cached state: a hit needs both the copy and its source
    hit = prompt + first.tokens["seed"][:2] + [5]
    sched.add_request(greq("hit", hit, 3))
    walks = []
    real_peek = sched.cache.peek
    sched.cache.peek = lambda tokens, limit: walks.append(limit) or real_peek(tokens, limit)  # type: ignore[method-assign]
    kv_free = sched.res.kv_alloc.num_free
    for _ in range(5):
        batch, _ = round_(sched, worker)
        assert rids(batch) == ["runner"]
    assert len(walks) == 1  # the first attempt walks; the four retries reuse the peek
    assert sched.metrics.get("hyssm_admission_refusals_total", reason="mamba_state") == 5
    assert sched.res.kv_alloc.num_free == kv_free - 5  # only the runner's decode slots were taken


def test_outputs_identical_with_and_without_cache_random(seed: int = 3) -> None:
    arrivals = pressure_requests(20, seed=seed)
    results = []
    for disable in (False, True):
        sched: Scheduler
        sched, worker = make(kv=300, states=5, chunked_prefill_size=16, max_prefill_tokens=48,
                             disable_radix_cache=disable)  # fmt: skip
        results.append(harness.run(sched, worker, arrivals).tokens)
    assert results[0] == results[1]


def test_prompt_kv_is_shared_while_the_request_decodes() -> None:
    """The second request arrives while the first is still decoding: the first's prompt KV is already in
    the tree, so the second finds the branch point and checkpoints it, and the third hits it."""
    sched, worker = make(disable_prompt_checkpoint=True, kv=1024, states=8, chunked_prefill_size=64)
    system = list(range(1, 61))
    sched.add_request(greq("a", system + [70, 71], 30))
    round_(sched, worker)  # a's prompt is done; a keeps decoding
    sched.add_request(greq("b", system + [80, 81], 3))
    # c arrives in the round where b's checkpoint copy runs: it copies from the checkpoint slot in that
    # same batch (checkpoint copies come first)
    log = harness.run(sched, worker, {1: [greq("c", system + [90, 91], 3)]}, keep_batches=True)
    assert log.finals["b"].cached_tokens == 0 and log.finals["c"].cached_tokens == len(system)
    both = [b for b in log.batches if any(op.rid is None for op in b.copies)]
    assert len(both) == 1 and [op.rid for op in both[0].copies] == [None, "c"]
    assert both[0].copies[0].dst == both[0].copies[1].src


def test_refused_rounds_cost_no_split_planning() -> None:
    """With periodic checkpoints a long prompt has prompt/interval split points; a refused retry must
    not list them every round (only the first one bounds the first chunk), so a round stays O(1)."""
    sched, worker = make(kv=4096, states=2, mamba_checkpoint_interval=4, chunked_prefill_size=4096,
                         max_prefill_tokens=4096, disable_prompt_checkpoint=True)  # fmt: skip
    prompt = list(range(1, 41))
    first = harness.run(sched, worker, {0: [greq("seed", prompt, 3)]})
    sched.add_request(greq("runner", [7, 7, 7], 40))
    round_(sched, worker)
    hit = prompt + first.tokens["seed"][:2] + list(range(50, 1050))  # 250 split points past the hit
    sched.add_request(greq("hit", hit, 3))
    plans = []
    real_plan = sched.res.plan_splits
    sched.res.plan_splits = lambda r, p: plans.append(r.rid) or real_plan(r, p)  # type: ignore[method-assign]
    for _ in range(4):
        batch, _ = round_(sched, worker)
        assert rids(batch) == ["runner"]
    assert plans == [] and sched.metrics.get("hyssm_admission_refusals_total", reason="mamba_state") == 4
    sched.res.plan_splits = real_plan  # type: ignore[method-assign]
    sched.abort("runner")  # capacity returns: admitted, the first chunk ends at the first split point
    batch, _ = round_(sched, worker)
    assert batch is not None and rids(batch) == ["hit"]
    assert batch.reqs[0].start_pos == len(prompt) + 2 and len(batch.reqs[0].input_ids) == 2  # 42 -> 44


@pytest.mark.parametrize("interval", [0, 5])
def test_first_split_is_the_first_planned_split(interval: int) -> None:
    rng = random.Random(interval)
    sched, _ = make(disable_prompt_checkpoint=True, mamba_checkpoint_interval=interval)
    for _ in range(300):
        n = rng.randrange(2, 60)
        sched.add_request(greq("x", [1] * n, 1))
        req = sched.reqs["x"]
        prefix = rng.randrange(0, n)
        peek = PeekResult(sched.cache.root, prefix, rng.randrange(prefix, n + 3), 0, 0, sched.cache.epoch)
        splits = sched.res.plan_splits(req, peek)
        assert sched.res.first_split(req, peek) == (splits[0] if splits else None), (n, peek)
        sched.abort("x")
