"""Scheduler API behaviour with the checking fake worker: validation, finishing, aborts, failures,
refusals, priorities, info/metrics."""

from __future__ import annotations

import msgspec
import pytest

from scheduler_proc.request import ReqStatus
from shared.messages import InfoResp, StepResult, ToTokenizer
from shared.model_info import ModelInfo
from tests.scheduler import harness
from tests.scheduler.util import ARCH, greq, make, rids, round_


def test_add_request_rejections() -> None:
    sched, _ = make(kv=32, states=4, context_length=40)
    sched.add_request(greq("a", [1, 2], 4))
    cases = {
        "a": ([1], 1, "duplicate"),
        "b": ([], 1, "empty prompt"),
        "c": ([1] * 20, 21, "context length"),
        "d": ([1] * 20, 14, "KV cache"),
    }
    for rid, (prompt, max_new, text) in cases.items():
        (out,) = sched.add_request(greq(rid, prompt, max_new))
        assert out.finished and out.finish_reason == "error" and text in (out.error or ""), out
    assert list(sched.reqs) == ["a"]
    (out,) = sched.add_request(greq("zero", [1, 2], 0))
    assert out.finished and out.finish_reason == "length" and out.token_ids == []
    sched.check_integrity()


def test_stop_conditions() -> None:
    model = ModelInfo(ARCH, ("mamba", "attention"), 50, (13,), 4096)
    sched, worker = make(model=model)
    worker.next_token = lambda seq: [13, 7, 9][len(seq) % 3]  # type: ignore[method-assign]
    sched.add_request(greq("eos", [1, 1], 10, ignore_eos=False))  # first token at len 2: 9, then 13
    sched.add_request(greq("ignore", [1, 1], 3, ignore_eos=True))
    sched.add_request(greq("stop", [1, 1, 1], 10, stop_token_ids=[9]))  # EOS ignored, stops on 9
    log = harness.run(sched, worker, {})
    assert log.finals["eos"].finish_reason == "stop" and log.tokens["eos"] == [9, 13]
    assert log.finals["eos"].matched_stop_token == 13 and log.finals["eos"].completion_tokens == 2
    assert log.finals["ignore"].finish_reason == "length" and log.tokens["ignore"] == [9, 13, 7]
    assert log.tokens["stop"] == [13, 7, 9] and log.finals["stop"].finish_reason == "stop"
    assert log.finals["stop"].matched_stop_token == 9


def test_abort_waiting_running_and_in_flight() -> None:
    sched, worker = make(max_running_requests=1)
    assert sched.abort("nobody") == []
    sched.add_request(greq("run", [1, 2, 3], 20))
    sched.add_request(greq("wait", [4, 5, 6], 20))
    round_(sched, worker)
    (out,) = sched.abort("wait", "client gone")
    assert out.finished and out.finish_reason == "abort" and "wait" not in sched.reqs
    batch = sched.schedule()
    assert rids(batch) == ["run"]
    assert sched.abort("run") == []  # in flight: finished when the result is applied
    assert batch is not None
    (out,) = sched.apply_result(worker.step(batch))
    assert out.finished and out.finish_reason == "abort" and out.token_ids == []
    assert not sched.has_work and sched.cache.kv_evictable == sched.cache.kv_total
    sched.check_integrity()
    assert sched.abort("run") == []


def test_transitions_keep_status_sets_and_version_together() -> None:
    """Every status change goes through `transition`: the queue, the running set, the request table
    and `running_version` follow it, and a move that is not a lifecycle step is refused."""
    sched, worker = make(max_running_requests=1)
    sched.add_request(greq("a", [1, 2, 3], 3))
    sched.add_request(greq("b", [4, 5, 6], 3))
    a, b, v0 = sched.reqs["a"], sched.reqs["b"], sched.running_version
    with pytest.raises(AssertionError, match="waiting -> waiting"):
        sched.transition(a, ReqStatus.WAITING)
    with pytest.raises(AssertionError, match="queue head"):
        sched.transition(b, ReqStatus.RUNNING)  # only the head of the queue is admitted
    round_(sched, worker)
    assert a.status is ReqStatus.RUNNING and list(sched.running) == ["a"] and sched.running_version == v0 + 1
    assert b.status is ReqStatus.WAITING and b in sched.waiting
    (out,) = sched.abort("b")
    assert out.finish_reason == "abort" and b.status is ReqStatus.FINISHED and "b" not in sched.reqs
    assert sched.running_version == v0 + 1  # the running set did not change
    with pytest.raises(AssertionError, match="finished -> waiting"):
        sched.transition(b, ReqStatus.WAITING)
    sched.abort("a")
    assert not sched.running and sched.running_version == v0 + 2 and not sched.reqs
    assert sched.cache.num_locked_nodes == 0
    sched.check_integrity()


def test_fail_all_frees_everything() -> None:
    sched, worker = make(kv=64, states=4, max_running_requests=2)
    for i in range(4):
        sched.add_request(greq(f"r{i}", [i, 1, 2, 3], 10))
    round_(sched, worker)
    assert sched.schedule() is not None  # a batch in flight
    outs = sched.fail_all("worker died")
    assert sorted(o.rid for o in outs) == ["r0", "r1", "r2", "r3"]
    assert all(o.finished and o.finish_reason == "error" and o.error == "worker died" for o in outs)
    assert sched.res.kv_alloc.num_free == 64 and sched.res.state_alloc.num_free == 4
    assert sched.cache.num_nodes == 0 and not sched.has_work and sched.in_flight is None
    sched.check_integrity()


def test_step_error_fails_everything() -> None:
    sched, worker = make()
    sched.add_request(greq("a", [1, 2], 5))
    batch = sched.schedule()
    assert batch is not None
    outs = sched.apply_result(StepResult(step=batch.step, error="boom"))
    assert [o.finish_reason for o in outs] == ["error"] and "boom" in (outs[0].error or "")
    sched.check_integrity()


def test_flush_cache_only_when_idle() -> None:
    sched, worker = make()
    sched.add_request(greq("a", [1, 2, 3], 5))
    round_(sched, worker)
    assert sched.flush_cache() is False
    harness.run(sched, worker, {})
    assert sched.cache.num_nodes > 0
    assert sched.flush_cache() is True
    assert sched.cache.num_nodes == 0 and sched.res.kv_alloc.num_free == sched.res.kv_alloc.capacity
    sched.check_integrity()


def test_worker_refusal_rolls_back_and_retries() -> None:
    sched, worker = make()
    prompt = [5, 6, 7, 8, 9]
    first = harness.run(sched, worker, {0: [greq("first", prompt, 3)]})
    second_prompt = prompt + first.tokens["first"][:2] + [1]
    refused_once: set[str] = set()

    def refuse(batch: object) -> frozenset[str]:
        for op in batch.copies:  # type: ignore[attr-defined]
            if op.rid is not None and op.rid not in refused_once:
                refused_once.add(op.rid)
                return frozenset({op.rid})
        return frozenset()

    log = harness.run(sched, worker, {0: [greq("second", second_prompt, 4)]}, refuse=refuse)
    assert refused_once == {"second"}
    assert sched.metrics.get("hyssm_admission_refusals_total", reason="worker_refusal") == 1
    assert log.finals["second"].cached_tokens == len(second_prompt) - 1
    ref_sched, ref_worker = make(disable_radix_cache=True)
    ref = harness.run(ref_sched, ref_worker, {0: [greq("second", second_prompt, 4)]})
    assert log.tokens["second"] == ref.tokens["second"]


def test_priority_policy_orders_the_queue() -> None:
    sched, worker = make(schedule_policy="priority", max_running_requests=1)
    sched.add_request(greq("low", [1, 2], 2, priority=0))
    sched.add_request(greq("high", [3, 4], 2, priority=5))
    sched.add_request(greq("mid", [5, 6], 2, priority=2))
    order: list[str] = []
    while sched.has_work:
        batch, _ = round_(sched, worker)
        order.extend(r for r in rids(batch) if r not in order)
    assert order == ["high", "mid", "low"]


def test_priority_preemption_retracts_lower_priority() -> None:
    sched, worker = make(
        kv=40, states=8, schedule_policy="priority", enable_priority_preemption=True, max_running_requests=2
    )
    sched.add_request(greq("low1", [1, 2, 3], 15, priority=0))
    sched.add_request(greq("low2", [4, 5, 6], 15, priority=0))
    round_(sched, worker)
    sched.add_request(greq("urgent", [7, 8, 9], 10, priority=9))
    batch, _ = round_(sched, worker)
    assert "urgent" in rids(batch)
    assert sched.metrics.get("hyssm_retractions_total", cause="priority") >= 1
    assert sched.reqs["low2"].status is ReqStatus.WAITING
    log = harness.run(sched, worker, {})
    assert set(log.finals) == {"urgent", "low1", "low2"}


def test_info_and_metrics_shape() -> None:
    sched, worker = make()
    harness.run(sched, worker, {0: [greq("a", [1, 2, 3], 4)], 1: [greq("b", [1, 2, 3, 9], 2)]})
    info = sched.info()
    server = info.server
    assert server.kv_free + server.kv_cached + server.kv_used_by_requests == server.kv_capacity == 256
    assert server.state_free + server.state_cached + server.state_used_by_requests == server.state_capacity == 8
    assert server.num_running == server.num_waiting == server.num_locked_nodes == 0
    assert server.prefix_queried_tokens == 7 and server.prefix_state_hit_tokens + server.prefix_kv_only_tokens > 0
    names = set()
    for rec in info.metrics:
        assert rec.name.startswith("hyssm_") and rec.type in ("counter", "gauge", "histogram")
        if rec.type != "histogram":
            assert isinstance(rec.value, int) if rec.type == "counter" else isinstance(rec.value, float)
        names.add(rec.name)
    for reason in ("kv", "mamba_state", "cow_alloc", "worker_refusal"):
        assert any(r.labels == {"reason": reason} for r in info.metrics
                   if r.name == "hyssm_admission_refusals_total")  # fmt: skip
    assert {"hyssm_admission_attempts_total", "hyssm_prefix_cache_hit_tokens_total", "hyssm_kv_slots",
            "hyssm_mamba_slots", "hyssm_num_waiting_reqs"} <= names  # fmt: skip
    # what crosses the process boundary decodes to the same typed value
    wire = msgspec.msgpack.encode(InfoResp(req_id=1, info=info))
    assert msgspec.msgpack.decode(wire, type=ToTokenizer) == InfoResp(req_id=1, info=info)


def test_info_message_rejects_a_bad_metric() -> None:
    """A metric name Prometheus cannot carry, or a non-number value, fails decoding at the receiver."""
    good = {"name": "hyssm_x", "type": "gauge", "help": "", "labels": {}, "value": 1.0}
    for bad in ({"name": "bad name!"}, {"value": True}, {"value": "1"}, {"type": "summary"}):
        doc = {"type": "InfoResp", "req_id": 1, "info": {"server": {}, "metrics": [{**good, **bad}]}}
        with pytest.raises(msgspec.ValidationError):
            msgspec.msgpack.decode(msgspec.msgpack.encode(doc), type=ToTokenizer)
    doc = {"type": "InfoResp", "req_id": 1, "info": {"server": {}, "metrics": [good]}}
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(doc), type=ToTokenizer).info.metrics[0].value == 1.0


@pytest.mark.parametrize("states", [1, 2])
def test_idle_admission_never_hangs_on_an_unaffordable_hit(states: int) -> None:
    """With one state slot in all, the cached state a prompt hits cannot be copied (the copy needs a
    second slot): when nothing runs, the request starts fresh instead of waiting forever."""
    sched, worker = make(kv=64, states=states)
    a = harness.run(sched, worker, {0: [greq("a", [1, 2, 3, 4], 3)]})
    prompt = [1, 2, 3, 4] + a.tokens["a"][:2] + [5]
    log = harness.run(sched, worker, {0: [greq("b", prompt, 3)]}, max_rounds=50)
    assert log.finals["b"].cached_tokens == (0 if states == 1 else len(prompt) - 1)


def test_step_error_fails_only_that_batch_and_drops_its_checkpoint() -> None:
    """A failed step may have written garbage into every slot it touched: its requests end with an
    error (nothing donated) and the checkpoint saved for it leaves the tree. Waiting requests and the
    rest of the cache are untouched, and serving goes on with correct outputs."""
    sched, worker = make(kv=512, states=8, chunked_prefill_size=512, max_running_requests=1)
    system = list(range(1, 41))
    harness.run(sched, worker, {0: [greq("a", system + [70, 71], 3)]})  # prompt KV shared, state at its end
    sched.add_request(greq("b", system + [80, 81], 3))
    sched.add_request(greq("w", [5, 6, 7], 3))
    b1, _ = round_(sched, worker)  # b computes up to the branch point (no sample)
    assert rids(b1) == ["b"] and b1 is not None and len(b1.reqs[0].input_ids) == len(system)
    b2 = sched.schedule()
    assert b2 is not None and [op.rid for op in b2.copies] == [None]  # the branch-point checkpoint
    outs = sched.apply_result(StepResult(step=b2.step, error="boom"))
    assert [(o.rid, o.finish_reason) for o in outs] == [("b", "error")] and "boom" in (outs[0].error or "")
    sched.check_integrity()
    assert "w" in sched.reqs and sched.cache.peek(system + [90], len(system)).prefix_len == 0
    assert sched.cache.peek(system + [70, 71, 0], 42).kv_len == 42  # the rest of the cache stays
    log = harness.run(sched, worker, {0: [greq("c", system + [90, 91], 3)]})
    assert set(log.finals) == {"w", "c"} and all(o.finish_reason == "length" for o in log.finals.values())
    ref_sched, ref_worker = make(disable_radix_cache=True)
    assert log.tokens["c"] == harness.run(ref_sched, ref_worker, {0: [greq("c", system + [90, 91], 3)]}).tokens["c"]


def test_the_first_tokens_tell_the_queue_time() -> None:
    """Each request's first TokenOut with tokens carries how long it waited for admission (the one that
    waited behind a full batch waited at least as long as the one admitted at once); later ones do not."""
    sched, worker = make(max_running_requests=1)
    sched.add_request(greq("first", [1, 2, 3], 3))
    sched.add_request(greq("second", [4, 5, 6], 3))
    outs: list = []
    while sched.reqs:
        outs += round_(sched, worker)[1]
    for rid in ("first", "second"):
        mine = [o for o in outs if o.rid == rid and o.token_ids]
        assert mine[0].queue_s >= 0 and all(o.queue_s == -1.0 for o in mine[1:]), mine
    waited = {o.rid: o.queue_s for o in outs if o.queue_s >= 0}
    assert waited["second"] >= waited["first"]


def test_a_finished_grammar_request_is_named_to_the_workers() -> None:
    """Rank 0 keeps a grammar matcher per request: the batch after a grammar request ends names it
    (ForwardBatch.ended) so the matcher is dropped; requests without a grammar are not named."""
    from shared.messages import GrammarSpec

    sched, worker = make()
    sched.add_request(greq("g", [1, 2, 3], 2, grammar=GrammarSpec(kind="regex", source="[a-z]+")))
    sched.add_request(greq("plain", [4, 5], 2))
    sched.add_request(greq("long", [6, 7], 6))
    batches = []
    while sched.reqs:
        batch, _ = round_(sched, worker)
        batches.append(batch)
    named = [b.ended for b in batches if b is not None]
    assert sum(named, []) == ["g"] and named[0] == []


def test_a_grammar_that_left_no_token_ends_as_the_clients_fault() -> None:
    """StepResult.grammar_rejected (the constraint left no token to sample) finishes the request as
    rejected, with the worker's message and none of that step's tokens; a grammar error that is not
    named there stays an internal error (with its tokens, as before)."""
    from shared.messages import GrammarSpec

    sched, worker = make()
    spec = GrammarSpec(kind="regex", source="[a-z]+")
    sched.add_request(greq("dead", [1, 2, 3], 8, grammar=spec))
    sched.add_request(greq("broken", [4, 5, 6], 8, grammar=spec))
    sched.add_request(greq("fine", [7, 8], 8, grammar=spec))
    while not all(r.num_output for r in sched.reqs.values()):
        round_(sched, worker)
    batch = sched.schedule()
    assert batch is not None
    result = worker.step(batch)
    result.grammar_errors = {"dead": "min_tokens 5 cannot be met: the constraint is complete after 2 tokens",
                             "broken": "structured output failed: sampled token 0 does not match the grammar"}
    result.grammar_rejected = ["dead"]
    outs = {o.rid: o for o in sched.apply_result(result)}
    dead, broken = outs["dead"], outs["broken"]
    assert dead.finished and dead.finish_reason == "error" and dead.rejected and dead.token_ids == []
    assert dead.error == "min_tokens 5 cannot be met: the constraint is complete after 2 tokens"
    assert broken.finished and broken.finish_reason == "error" and not broken.rejected
    assert broken.token_ids == [result.next_tokens["broken"]] and "does not match" in (broken.error or "")
    assert not outs["fine"].finished and set(sched.reqs) == {"fine"}
    sched.check_integrity()
    nxt = sched.schedule()
    assert nxt is not None and sorted(nxt.ended) == ["broken", "dead"]
