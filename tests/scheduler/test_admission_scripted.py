"""Scripted scheduler tests with stand-in collaborators (issue 4 acceptance, first block)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from scheduler_proc.admission import AdderBudget, AddResult, Grant
from scheduler_proc.retry import RetryPolicy
from scheduler_proc.scheduler import Scheduler
from shared.config import ServerArgs
from tests.scheduler.util import ATTENTION_ONLY, HYBRID, greq, make, rids, round_

CONFIGS = {
    # name: (model, ServerArgs overrides, latch cleared every round)
    "hybrid_state_cache": (HYBRID, {}, True),
    "hybrid_priority_preemption": (HYBRID, {"disable_radix_cache": True, "enable_priority_preemption": True}, True),
    "attention_only_priority_preemption": (ATTENTION_ONLY, {"enable_priority_preemption": True}, True),
    "hybrid_radix_disabled": (HYBRID, {"disable_radix_cache": True}, False),
    "attention_only": (ATTENTION_ONLY, {}, False),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_latch_policy_per_configuration(name: str) -> None:
    model, overrides, every_round = CONFIGS[name]
    policy = RetryPolicy.for_config(ServerArgs(**overrides), model)
    assert policy.clear_every_round is every_round
    policy.begin_round(running_version=3, running_empty=False)
    policy.on_no_token()
    policy.begin_round(running_version=3, running_empty=False)  # running batch unchanged
    assert policy.should_attempt() is every_round
    policy.on_no_token()
    policy.begin_round(running_version=4, running_empty=False)  # running batch changed: always retried
    assert policy.should_attempt()


def test_latch_cleared_for_sliding_window_models() -> None:
    args = ServerArgs(disable_radix_cache=True)
    assert RetryPolicy.for_config(args, ATTENTION_ONLY, sliding_window=True).clear_every_round
    assert not RetryPolicy.for_config(args, ATTENTION_ONLY).clear_every_round


class StandInAdder:
    """Adder stand-in: answers from a script (one AddResult per call), logs calls and rollbacks."""

    def __init__(self, script: Iterator[AddResult], log: dict[str, list[Any]]) -> None:
        self.script, self.log = script, log
        self.granted: list[Grant] = []
        self.refusal_reason = ""

    def add_one_req(self, req: Any, match: Any, max_chunk: int) -> tuple[AddResult, Grant | None]:
        self.log["calls"].append(req.rid)
        result = next(self.script)
        if result is not AddResult.CONTINUE:
            self.refusal_reason = "kv"
            return result, None
        grant = Grant(0, 0, min(len(req.tokens) - match.prefix_len, max_chunk))
        self.granted.append(grant)
        return result, grant

    def rollback(self, grant: Grant) -> None:
        self.granted.remove(grant)
        self.log["rollbacks"].append(grant)


def install(sched: Scheduler, script: list[AddResult]) -> dict[str, list[Any]]:
    log: dict[str, list[Any]] = {"calls": [], "rollbacks": [], "rounds": []}
    it = iter(script)

    def factory(budget: AdderBudget) -> Any:
        log["rounds"].append(budget)
        return StandInAdder(it, log)

    sched.admission.adder_factory = factory  # type: ignore[assignment]
    return log


@pytest.mark.parametrize("name", list(CONFIGS))
def test_no_token_stand_in_attempts_per_round(name: str) -> None:
    model, overrides, every_round = CONFIGS[name]
    sched, worker = make(model=model, **overrides)
    sched.add_request(greq("running", [1, 2, 3], 50))
    round_(sched, worker)  # admitted with the real adder; stays running, the batch never changes
    log = install(sched, [AddResult.NO_TOKEN] * 10)
    sched.add_request(greq("queued", [4, 5, 6], 5))
    for _ in range(3):
        batch, _ = round_(sched, worker)
        assert rids(batch) == ["running"]
    assert log["calls"] == ["queued"] * (3 if every_round else 1)
    assert sched.waiting.peek() is sched.reqs["queued"]


def test_refuse_then_cow_error_then_admit() -> None:
    """Round 1 the adder refuses; round 2 the adder lets the request through but the real copy-on-write
    match raises StateCowAllocError (every state slot is held: one by a running request, one by the
    cached state the match itself locks): no batch entry for it, it stays queued in its place and the
    adder's grant is rolled back (the adder admits nothing); round 3 capacity is back (the running
    request finished and donated its state) and it is admitted, waiting queue empty."""
    sched, worker = make(kv=256, states=2)
    sched.add_request(greq("donor", [1, 2, 3, 4, 5, 6], 3))
    sched.add_request(greq("runner", [40, 41, 42], 5))
    outs: dict[str, list[int]] = {"donor": [], "runner": []}
    for _ in range(3):  # donor: prefill + 2 decodes, finishes and donates its state at 6 + 2 positions
        _, got = round_(sched, worker)
        for o in got:
            outs[o.rid].extend(o.token_ids)
    assert "donor" not in sched.reqs and sched.cache.states_total == 1
    prompt = [1, 2, 3, 4, 5, 6] + outs["donor"][:2] + [7]
    assert sched.cache.peek(prompt, len(prompt) - 1).prefix_len == 8
    log = install(sched, [AddResult.NO_TOKEN, AddResult.CONTINUE, AddResult.CONTINUE])
    sched.add_request(greq("hit", prompt, 4))

    batch, _ = round_(sched, worker)  # round 1: the adder refuses
    assert rids(batch) == ["runner"] and log["calls"] == ["hit"] and not log["rollbacks"]

    batch, got = round_(sched, worker)  # round 2: the CoW match raises; the runner finishes meanwhile
    assert rids(batch) == ["runner"] and batch is not None and not batch.copies
    assert sched.waiting.peek() is sched.reqs["hit"] and len(sched.waiting) == 1
    assert len(log["rollbacks"]) == 1 and sched.metrics.get("hyssm_admission_refusals_total", reason="cow_alloc") == 1
    assert sched.reqs["hit"].state_slot is None and not sched.reqs["hit"].kv_slots
    assert [o.finish_reason for o in got] == ["length"]  # the runner donated its state

    batch, _ = round_(sched, worker)  # round 3: admitted with a copy-on-write of the cached state
    assert rids(batch) == ["hit"] and len(sched.waiting) == 0
    assert batch is not None and len(batch.copies) == 1 and batch.copies[0].rid == "hit"
    assert batch.reqs[0].start_pos == 8 and log["calls"] == ["hit"] * 3


LATCHED = {name: cfg for name, cfg in CONFIGS.items() if not cfg[2]}


@pytest.mark.parametrize("name", list(LATCHED))
def test_latch_cleared_when_the_refused_head_leaves_the_queue(name: str) -> None:
    """The latch says "the head cannot fit until something changes". When the refused head is aborted
    while the running batch stays the same, the request behind it (which fits) is admitted at once,
    not after the long-running request ends."""
    model, overrides, _ = LATCHED[name]
    sched, worker = make(kv=64, model=model, **overrides)
    sched.add_request(greq("long", [1, 2, 3], 40))
    round_(sched, worker)
    sched.add_request(greq("big", list(range(1, 40)), 10))  # needs more KV than is left beside "long"
    sched.add_request(greq("small", [4, 5], 2))
    batch, _ = round_(sched, worker)
    assert rids(batch) == ["long"] and sched.metrics.get("hyssm_admission_refusals_total", reason="kv") == 1
    batch, _ = round_(sched, worker)
    assert rids(batch) == ["long"]  # latched: the unchanged head is not retried
    (out,) = sched.abort("big")
    assert out.finish_reason == "abort"
    batch, _ = round_(sched, worker)
    assert rids(batch) == ["long", "small"]


@pytest.mark.parametrize("name", list(LATCHED))
def test_latch_cleared_when_a_higher_priority_request_becomes_the_head(name: str) -> None:
    model, overrides, _ = LATCHED[name]
    sched, worker = make(kv=64, model=model, schedule_policy="priority", **overrides)
    sched.add_request(greq("long", [1, 2, 3], 40))
    round_(sched, worker)
    sched.add_request(greq("big", list(range(1, 40)), 10))
    round_(sched, worker)
    assert sched.retry.batch_is_full
    sched.add_request(greq("urgent", [4, 5], 2, priority=5))
    batch, _ = round_(sched, worker)
    assert rids(batch) == ["long", "urgent"]
