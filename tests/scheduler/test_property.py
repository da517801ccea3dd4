"""Property test (hypothesis): random sequences of arrive / dispatch / complete (with worker refusals, or
a step error that fails that batch only) / step / abort (queued, running, in flight) / evict / flush
(idle, busy, in flight) / fail keep every invariant, and nothing is lost, stuck or corrupted.

A batch may stay in flight across rules, so arrivals, aborts, flush requests and failures land while
the workers run it, as they do in the scheduler process. The fake worker verifies every slice's slots
before running it, and its outputs are a pure function of the token sequence, so every finished
request's tokens must equal an independent reference. Liveness: with nothing running, the head of the
queue is admitted in that very round (nothing else can free capacity for it)."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from scheduler_proc.scheduler import Scheduler, SchedulerTuning
from shared.messages import ForwardBatch, StepResult, TokenOut
from tests.scheduler.fake_worker import FakeWorker
from tests.scheduler.harness import RunLog
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
        max_running=st.sampled_from([1, 2, 6]),
    )
    def setup(self, kv: int, states: int, chunk: int, disable: bool, priority: bool, preempt: bool,
              interval: int, ratio: float, max_running: int) -> None:  # fmt: skip
        tuning = SchedulerTuning(init_ratio=ratio, min_ratio=min(ratio, 0.05))
        self.sched, self.worker = make(
            kv=kv, states=states, chunked_prefill_size=chunk, max_prefill_tokens=max(chunk, 32),
            disable_radix_cache=disable, schedule_policy="priority" if priority else "fcfs",
            enable_priority_preemption=preempt, mamba_checkpoint_interval=interval,
            max_running_requests=max_running, tuning=tuning,
        )  # fmt: skip
        self.n = 0
        self.expected: dict[str, list[int]] = {}
        self.log = RunLog()  # every reply, at most one final one per request
        self.first_start: dict[str, int] = {}  # start of the first admitted slice that ran
        self.batch: ForwardBatch | None = None  # in flight between `dispatch` and `complete`
        self.seen_running: tuple[frozenset[str], int] = (frozenset(), self.sched.running_version)

    def take(self, outs: list[TokenOut]) -> None:
        self.log.take(outs)
        for out in outs:
            if out.finished:
                self.check_output(out)

    def check_output(self, out: TokenOut) -> None:
        got, want = self.log.tokens.get(out.rid, []), self.expected.get(out.rid)
        if want is None:  # rejected at add_request
            assert out.finish_reason == "error"
            return
        if out.finish_reason == "length":
            assert got == want, f"{out.rid}: {got} != {want}"
        else:
            assert out.finish_reason in ("abort", "error") and got == want[: len(got)], (out, got, want)
        if out.rid in self.first_start:
            assert out.cached_tokens == self.first_start[out.rid], (out, self.first_start[out.rid])
        else:
            assert out.cached_tokens == 0, out
        assert out.cached_tokens < out.prompt_tokens

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

    # ------------------------------------------------------------------ rounds
    def schedule(self) -> ForwardBatch | None:
        s = self.sched
        idle_head = s.waiting.peek() if not s.running else None
        batch = s.schedule()
        s.check_integrity()
        if idle_head is not None:  # nothing else can ever free capacity for it: it must start now
            assert batch is not None and idle_head.rid in [r.rid for r in batch.reqs], (idle_head, s.info().server)
        return batch

    def run_batch(self, batch: ForwardBatch, refused: frozenset[str], error: str = "") -> None:
        """`error`: "before" (the step failed before writing anything) or "after" (it wrote everything
        and then failed): either way only its requests end, and the survivors' outputs stay exact."""
        fl = self.sched.in_flight
        assert fl is not None
        if error:
            if error == "after":
                self.worker.step(batch, refused)
            result = StepResult(step=batch.step, error="injected step error")
            in_batch = {e.req.rid for e in fl.entries}
            outs = self.sched.apply_result(result)
            assert sorted(o.rid for o in outs) == sorted(in_batch) and all(o.finish_reason == "error" for o in outs)
            self.take(outs)
            return
        result = self.worker.step(batch, refused)
        for e in fl.entries:
            if e.admitted and e.req.rid not in refused:
                self.first_start.setdefault(e.req.rid, e.start)
        self.take(self.sched.apply_result(result))

    @precondition(lambda self: self.batch is None)
    @rule(refuse_cow=st.booleans(), abort_in_flight=st.booleans())
    def step(self, refuse_cow: bool, abort_in_flight: bool) -> None:
        batch = self.schedule()
        if batch is None:
            return
        if abort_in_flight and batch.reqs:
            assert self.sched.abort(batch.reqs[-1].rid) == []
        refused = frozenset(op.rid for op in batch.copies if op.rid is not None) if refuse_cow else frozenset()
        self.run_batch(batch, refused)

    @precondition(lambda self: self.batch is None)
    @rule()
    def dispatch(self) -> None:
        self.batch = self.schedule()

    @precondition(lambda self: self.batch is not None)
    @rule(refuse=st.sets(st.integers(0, 7)), error=st.sampled_from([""] * 8 + ["before", "after"]))
    def complete(self, refuse: set[int], error: str) -> None:
        batch, self.batch = self.batch, None
        assert batch is not None
        cows = [op.rid for op in batch.copies if op.rid is not None]
        refused = frozenset(cows[i] for i in refuse if i < len(cows))
        self.run_batch(batch, refused, error)

    # ------------------------------------------------------------------ other events
    @rule(which=st.integers(0, 200))
    def abort(self, which: int) -> None:
        live = sorted(self.sched.reqs)
        if not live:
            return
        rid = live[which % len(live)]
        outs = self.sched.abort(rid, "test")
        if self.batch is not None and any(r.rid == rid for r in self.batch.reqs):
            assert outs == [], "an in-flight request is finished when its result is applied"
        else:
            assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason == "abort"
        self.take(outs)

    @precondition(lambda self: self.batch is None)
    @rule(n=st.integers(1, 40), states=st.booleans())
    def evict(self, n: int, states: bool) -> None:
        cache = self.sched.cache
        cache.evict_states(n % 4 + 1) if states else cache.evict_kv(n)

    @rule()
    def flush(self) -> None:
        idle = not self.sched.running and self.sched.in_flight is None
        assert self.sched.flush_cache() is idle
        if idle:
            assert self.sched.cache.num_nodes == 0

    @precondition(lambda self: self.n % 7 == 6)
    @rule()
    def fail(self) -> None:
        self.batch = None  # a failing scheduler drops the batch in flight with everything else
        self.take(self.sched.fail_all("test failure"))
        assert not self.sched.has_work

    @invariant()
    def integrity(self) -> None:
        self.sched.check_integrity()

    @invariant()
    def running_version_follows_the_running_set(self) -> None:
        """The retry latch of attention-only models waits for `running_version`: it must change
        whenever the running set did (and never go back)."""
        s, (before, version) = self.sched, self.seen_running
        now = frozenset(s.running)
        assert s.running_version >= version
        if now != before:
            assert s.running_version != version, f"running set {sorted(before)} -> {sorted(now)}, same version"
        self.seen_running = (now, s.running_version)

    @invariant()
    def reusable_peeks_are_fresh(self) -> None:
        """The O(1) retry reuses a waiting request's last peek while the cache epoch is unchanged: it
        must then equal a fresh walk (no stale match or cost survives a lock release, donation, flush,
        abort or eviction). With a state cache, admission is tried every round (never latched)."""
        s = self.sched
        for r in s.waiting.items():
            p = r.peek
            if p is None or p.epoch != s.cache.epoch or not s.res.cache_enabled:
                continue
            q = s.cache.peek(r.tokens, len(r.tokens) - 1)
            assert (p.node, p.prefix_len, p.kv_len, p.lock_cost_kv, p.state_lock_cost) == (
                q.node, q.prefix_len, q.kv_len, q.lock_cost_kv, q.state_lock_cost
            ), (r, p, q)  # fmt: skip
        if s.retry.clear_every_round:
            assert s.metrics.get("hyssm_admission_rounds_total", outcome="latched") == 0

    def teardown(self) -> None:
        if self.batch is not None:
            self.complete(set(), "")
        for _ in range(2000):
            if not self.sched.has_work:
                break
            self.step(False, False)
        assert not self.sched.has_work, "requests stuck"
        missing = set(self.expected) - set(self.log.finals)
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
