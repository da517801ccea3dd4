"""A rid is free again once its request is aborted, even while that request's slice is in flight
(issue 17, defect 2): the reusing request is admitted when the holder leaves, never rejected."""

from __future__ import annotations

from tests.scheduler.util import greq, make, round_


def test_reuse_while_the_aborted_holder_is_in_flight() -> None:
    sched, worker = make()
    assert sched.add_request(greq("r", [1, 2, 3], 8)) == []
    batch = sched.schedule()
    assert batch is not None and [s.rid for s in batch.reqs] == ["r"]
    assert sched.abort("r", "stop string matched") == []  # its slice is in flight
    assert sched.add_request(greq("r", [4, 5], 3)) == []  # not a duplicate
    second = sched.add_request(greq("r", [6], 3))  # a third one while the second waits is one
    assert len(second) == 1 and second[0].rejected and "duplicate" in (second[0].error or "")
    outs = sched.apply_result(worker.step(batch, frozenset()))
    assert [(o.rid, o.finish_reason, o.token_ids) for o in outs] == [("r", "abort", [])]
    sched.check_integrity()
    assert sched.reqs["r"].tokens == [4, 5]  # the reusing request took the rid
    finals = []
    for _ in range(10):
        _, outs = round_(sched, worker)
        finals += [o for o in outs if o.finished]
        if finals:
            break
    assert [(o.rid, o.finish_reason, o.completion_tokens, o.prompt_tokens) for o in finals] == [("r", "length", 3, 2)]
    assert not sched.reqs


def test_abort_of_the_reusing_request_and_fail_all() -> None:
    sched, worker = make()
    sched.add_request(greq("r", [1, 2, 3], 8))
    batch = sched.schedule()
    assert batch is not None
    sched.abort("r")
    sched.add_request(greq("r", [4, 5], 3))
    (out,) = sched.abort("r", "client disconnected")  # meant for the waiting reuser
    assert out.rid == "r" and out.finish_reason == "abort" and out.prompt_tokens == 2
    sched.apply_result(worker.step(batch, frozenset()))
    assert not sched.reqs and not sched.has_work
    sched.check_integrity()

    sched.add_request(greq("q", [1, 2], 8))
    assert sched.schedule() is not None
    sched.abort("q")
    sched.add_request(greq("q", [3], 2))
    outs = sched.fail_all("worker died")
    assert sorted((o.prompt_tokens, o.finish_reason) for o in outs) == [(1, "error"), (2, "error")]
    assert not sched.reqs


def test_rejection_that_can_never_fit_names_the_pool() -> None:
    sched, _ = make(kv=64)
    (out,) = sched.add_request(greq("big", [1] * 60, 10))
    assert out.finished and out.finish_reason == "error" and out.rejected
    assert "64" in (out.error or "") and "--max-total-tokens" in (out.error or "")
