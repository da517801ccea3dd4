"""Drive a Scheduler and a worker runner together in-process: schedule -> runner.step -> apply_result.

`runner` is anything with `step(batch, refused) -> StepResult`: the FakeWorker of this package or
worker_proc.runtime.runner.ModelRunner (real CPU tensors). Integrity is checked after every applied step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from scheduler_proc.scheduler import Scheduler
from shared.messages import ForwardBatch, GenerateReq, StepResult, TokenOut


class Runner(Protocol):
    def step(self, batch: ForwardBatch, refused: frozenset[str] = ...) -> StepResult: ...


@dataclass
class RunLog:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finals: dict[str, TokenOut] = field(default_factory=dict)
    rounds: int = 0
    batches: list[ForwardBatch] = field(default_factory=list)

    def take(self, outs: list[TokenOut]) -> None:
        for out in outs:
            assert out.rid not in self.finals, f"{out.rid}: output after its final reply"
            self.tokens.setdefault(out.rid, []).extend(out.token_ids)
            if out.finished:
                self.finals[out.rid] = out


def run(
    sched: Scheduler,
    runner: Runner,
    arrivals: dict[int, list[GenerateReq]],
    max_rounds: int = 10_000,
    refuse: Callable[[ForwardBatch], frozenset[str]] | None = None,
    on_round: Callable[[int, Scheduler], None] | None = None,
    keep_batches: bool = False,
) -> RunLog:
    """Requests in arrivals[k] are added before round k. Runs until every request has its final reply."""
    log = RunLog()
    expected = {r.rid for reqs in arrivals.values() for r in reqs}
    last_arrival = max(arrivals, default=0)
    for rnd in range(max_rounds):
        for req in arrivals.get(rnd, []):
            log.take(sched.add_request(req))
        if on_round is not None:
            on_round(rnd, sched)
        batch = sched.schedule()
        sched.check_integrity()
        if batch is None:
            if rnd >= last_arrival and not sched.has_work:
                break
            assert not sched.running, f"round {rnd}: running requests but no batch"
            continue
        if keep_batches:
            log.batches.append(batch)
        refused = refuse(batch) if refuse is not None else frozenset()
        log.take(sched.apply_result(runner.step(batch, refused)))
        sched.check_integrity()
        log.rounds = rnd + 1
    else:
        raise AssertionError(f"not drained after {max_rounds} rounds: {sched.info().server}")
    missing = expected - set(log.finals)
    assert not missing, f"no final reply for {sorted(missing)[:5]}"
    return log
