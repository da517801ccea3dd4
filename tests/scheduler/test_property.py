"""Property test (hypothesis): random sequences of arrive / step (admit, run, finish, refuse) / abort /
evict / flush / fail keep every invariant, and nothing is lost or corrupted.

The fake worker verifies every slice's slots before running it, and its outputs are a pure function
of the token sequence, so every finished request's tokens must equal an independent reference."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from scheduler_proc.scheduler import Scheduler, SchedulerTuning
from shared.messages import TokenOut
from tests.scheduler.fake_worker import FakeWorker
from tests.scheduler.util import greq, make

PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 9, 9], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31], []]


class SchedulerMachine(RuleBasedStateMachine):
    sched: Scheduler
    worker: FakeWorker

    @initialize(
        kv=st.integers(24, 160),
        states=st.integers(1, 8),
        chunk=st.sampled_from([4, 16, 64]),
        disable=st.booleans(),
        priority=st.booleans(),
        preempt=st.booleans(),
        interval=st.sampled_from([0, 0, 6]),
        ratio=st.sampled_from([0.0, 0.3, 1.0]),
    )
    def setup(self, kv: int, states: int, chunk: int, disable: bool, priority: bool, preempt: bool,
              interval: int, ratio: float) -> None:  # fmt: skip
        tuning = SchedulerTuning(init_ratio=ratio, min_ratio=min(ratio, 0.05))
        self.sched, self.worker = make(
            kv=kv, states=states, chunked_prefill_size=chunk, max_prefill_tokens=max(chunk, 32),
            disable_radix_cache=disable, schedule_policy="priority" if priority else "fcfs",
            enable_priority_preemption=preempt, mamba_checkpoint_interval=interval, max_running_requests=6,
            tuning=tuning,
        )  # fmt: skip
        self.n = 0
        self.expected: dict[str, list[int]] = {}
        self.got: dict[str, list[int]] = {}
        self.finals: dict[str, TokenOut] = {}

    def take(self, outs: list[TokenOut]) -> None:
        for out in outs:
            assert out.rid not in self.finals, f"{out.rid}: reply after its final reply"
            self.got.setdefault(out.rid, []).extend(out.token_ids)
            if out.finished:
                self.finals[out.rid] = out
                self.check_output(out)

    def check_output(self, out: TokenOut) -> None:
        got, want = self.got.get(out.rid, []), self.expected.get(out.rid)
        if want is None:  # rejected at add_request
            assert out.finish_reason == "error"
            return
        if out.finish_reason == "length":
            assert got == want, f"{out.rid}: {got} != {want}"
        else:
            assert out.finish_reason in ("abort", "error") and got == want[: len(got)], (out, got, want)

    def reference(self, prompt: list[int], n: int) -> list[int]:
        seq, out = list(prompt), []
        for _ in range(n):
            tok = self.worker.next_token(tuple(seq))
            out.append(tok)
            seq.append(tok)
        return out

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(1, 40), min_size=1, max_size=10),
          max_new=st.integers(1, 12), prio=st.integers(0, 3))  # fmt: skip
    def arrive(self, prefix: list[int], suffix: list[int], max_new: int, prio: int) -> None:
        rid = f"r{self.n}"
        self.n += 1
        prompt = prefix + suffix
        outs = self.sched.add_request(greq(rid, prompt, max_new, priority=prio))
        if not outs:
            self.expected[rid] = self.reference(prompt, max_new)
        self.take(outs)

    @rule(refuse_cow=st.booleans(), abort_in_flight=st.booleans())
    def step(self, refuse_cow: bool, abort_in_flight: bool) -> None:
        batch = self.sched.schedule()
        self.sched.check_integrity()
        if batch is None:
            return
        if abort_in_flight and batch.reqs:
            assert self.sched.abort(batch.reqs[-1].rid) == []
        refused = frozenset(op.rid for op in batch.copies if op.rid is not None) if refuse_cow else frozenset()
        self.take(self.sched.apply_result(self.worker.step(batch, refused)))

    @rule(which=st.integers(0, 200))
    def abort(self, which: int) -> None:
        live = sorted(self.sched.reqs)
        if live:
            self.take(self.sched.abort(live[which % len(live)], "test"))

    @rule(n=st.integers(1, 40), states=st.booleans())
    def evict(self, n: int, states: bool) -> None:
        cache = self.sched.cache
        cache.evict_states(n % 4 + 1) if states else cache.evict_kv(n)

    @rule()
    def flush(self) -> None:
        idle = not self.sched.running
        assert self.sched.flush_cache() is idle
        if idle:
            assert self.sched.cache.num_nodes == 0

    @precondition(lambda self: self.n % 7 == 6)
    @rule()
    def fail(self) -> None:
        self.take(self.sched.fail_all("test failure"))
        assert not self.sched.has_work

    @invariant()
    def integrity(self) -> None:
        self.sched.check_integrity()

    def teardown(self) -> None:
        for _ in range(2000):
            if not self.sched.has_work:
                break
            self.step(False, False)
        assert not self.sched.has_work, "requests stuck"
        missing = set(self.expected) - set(self.finals)
        assert not missing, f"no final reply for {missing}"
        cache, res = self.sched.cache, self.sched.res
        assert cache.num_locked_nodes == 0 and cache.kv_evictable == cache.kv_total
        assert cache.states_evictable == cache.states_total
        assert res.kv_alloc.num_free + cache.kv_total == res.kv_alloc.capacity
        assert res.state_alloc.num_free + cache.states_total == res.state_alloc.capacity
        self.sched.check_integrity()


SchedulerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestSchedulerProperties = SchedulerMachine.TestCase
