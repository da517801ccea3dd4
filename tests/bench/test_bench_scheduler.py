"""benchmarks/bench_scheduler.py at a tiny size: each exhausted resource refuses the queue's head
every round for its own reason, and the head is admitted as soon as capacity comes back (the bench's
own checks raise otherwise)."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_scheduler


@pytest.mark.parametrize("limit", ["state", "kv"])
def test_bench_scheduler_refuses_for_its_reason_and_admits_on_return(limit: str, capsys) -> None:
    bench_scheduler.main(["--queued", "40", "--prefix", "64", "--rounds", "30", "--limits", limit, "--json"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["limit"], r["reason"], r["queued"]) for r in rows] == [(limit, bench_scheduler.REASONS[limit], 40)]
    assert rows[0]["round_us"] > 0 and rows[0]["admit_round_us"] > 0


def test_bench_scheduler_notices_a_scenario_that_stops_refusing(monkeypatch) -> None:
    """A scenario whose head gets admitted while capacity should be exhausted fails the bench."""
    real = bench_scheduler.build

    def roomy(limit: str, queued: int, prefix_len: int, runner_new: int):
        sched = real(limit, queued, prefix_len, runner_new)
        for rid in list(sched.running):
            sched.abort(rid)  # capacity back before the timed rounds
        return sched

    monkeypatch.setattr(bench_scheduler, "build", roomy)
    with pytest.raises(AssertionError, match="not refused every round"):
        bench_scheduler.run(["state"], [10], [32], 9)
