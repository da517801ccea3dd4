"""ReqSlice.kv_reuse from the scheduler's side: a slice sends only the KV slots the workers do not hold
from the previous batch, and the slots the workers reconstruct are always exactly the request's
kv_slots at build time (retractions, refusals, failed steps, checkpoints and cache re-binding included).

`MirrorModel` is an independent model of the worker's mirror (worker_proc.model.kv_mirror's rules):
it never trusts a kv_reuse it cannot serve, and it compares what it rebuilds with the scheduler's own
kv_slots, which the fake worker alone cannot see.
"""

from __future__ import annotations

import random
from collections import Counter

from scheduler_proc.request import Req
from scheduler_proc.scheduler import Scheduler, SchedulerTuning
from shared.messages import ForwardBatch, GenerateReq, StepResult
from tests.scheduler.fake_worker import FakeWorker
from tests.scheduler.util import greq, make, round_

OPTIMISTIC = SchedulerTuning(init_ratio=0.05, min_ratio=0.05)  # admits on hope: decodes run out of KV


class MirrorModel:
    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.slots: dict[str, list[int]] = {}
        self.step: int | None = None
        self.released: set[str] = set()  # rids that gave back their slots since their last slice
        self.stats: Counter[str] = Counter()
        release = sched.res.release

        def recording_release(req: Req, donate: bool, keep: bool = False) -> None:
            self.released.add(req.rid)
            release(req, donate, keep)

        sched.res.release = recording_release  # type: ignore[method-assign]

    def check(self, batch: ForwardBatch) -> dict[str, list[int]]:
        """Rebuild every slice's full slot list; each must equal the request's kv_slots right now."""
        held = self.slots if self.step is not None and batch.step == self.step + 1 else {}
        full: dict[str, list[int]] = {}
        for s in batch.reqs:
            truth = self.sched.reqs[s.rid].kv_slots
            if s.kv_reuse:
                assert s.rid not in self.released, f"{s.rid}: kv_reuse {s.kv_reuse} after giving back its slots"
                assert len(held.get(s.rid, [])) >= s.kv_reuse, f"{s.rid}: kv_reuse {s.kv_reuse} not held"
                self.stats["reused"] += 1
                self.stats["decode_reused"] += len(s.input_ids) == 1
            else:
                self.stats["full"] += 1
            full[s.rid] = held.get(s.rid, [])[: s.kv_reuse] + s.kv_slots
            assert full[s.rid] == truth, f"step {batch.step} {s.rid}: workers would use other slots"
            self.released.discard(s.rid)
        return full

    def ran(self, batch: ForwardBatch, full: dict[str, list[int]], refused: frozenset[str], failed: bool) -> None:
        if failed:
            self.slots, self.step = {}, None
            return
        self.slots = {rid: kv for rid, kv in full.items() if rid not in refused}
        self.step = batch.step


def drive(sched: Scheduler, worker: FakeWorker, arrivals: dict[int, list[GenerateReq]], seed: int,
          refuse_p: float = 0.0, fail_p: float = 0.0, rounds: int = 3000) -> MirrorModel:  # fmt: skip
    """Rounds with the fake worker until every request finished; refusals of copy-on-write and failed
    steps (before or after writing) injected at random."""
    rng = random.Random(seed)
    mirror = MirrorModel(sched)
    last = max(arrivals, default=0)
    for rnd in range(rounds):
        for req in arrivals.get(rnd, []):
            sched.add_request(req)
        batch = sched.schedule()
        sched.check_integrity()
        if batch is None:
            if rnd >= last and not sched.has_work:
                return mirror
            continue
        full = mirror.check(batch)
        cows = [op.rid for op in batch.copies if op.rid is not None]
        refused = frozenset(rid for rid in cows if rng.random() < refuse_p)
        failed = rng.random() < fail_p
        if failed:
            if rng.random() < 0.5:
                worker.step(batch, refused)  # the step wrote everything, then failed
            result = StepResult(step=batch.step, error="injected")
            mirror.stats["failed"] += 1
        else:
            result = worker.step(batch, refused)
            mirror.stats["refused"] += len(result.refused)
        mirror.ran(batch, full, refused, failed)
        sched.apply_result(result)
        sched.check_integrity()
    raise AssertionError("not drained")


def test_chunks_and_decodes_send_only_new_slots() -> None:
    sched, worker = make(kv=128, states=8, chunked_prefill_size=16, mamba_checkpoint_interval=8)
    sched.add_request(greq("a", list(range(1, 41)), 6))
    slices = []
    while sched.has_work:
        batch, _ = round_(sched, worker)
        assert batch is not None
        slices.extend(batch.reqs)
    assert [(s.start_pos, s.kv_reuse, len(s.kv_slots)) for s in slices] == [
        (0, 0, 8), (8, 8, 8), (16, 16, 8), (24, 24, 8), (32, 32, 8),  # chunks cut at every checkpoint
        (40, 40, 1), (41, 41, 1), (42, 42, 1), (43, 43, 1), (44, 44, 1),  # decodes: one slot each
    ]  # fmt: skip


def test_many_decoding_requests_reuse_every_step() -> None:
    sched, worker = make(kv=512, states=16, max_running_requests=8)
    mirror = drive(sched, worker, {0: [greq(f"r{i}", [i + 1] * (10 + i), 12) for i in range(8)]}, seed=0)
    assert mirror.stats["decode_reused"] == 8 * 11 and mirror.stats["full"] == 8


def test_retractions_refusals_and_failures_resend_full_lists() -> None:
    """Tight KV (retractions), a shared prefix (cache hits, copy-on-write, checkpoints, re-binding to
    tree slots), refused copy-on-write and failed steps: whatever is reused is exactly right."""
    total: Counter[str] = Counter()
    for seed in range(6):
        sched, worker = make(kv=80, states=10, tuning=OPTIMISTIC, chunked_prefill_size=12, mamba_checkpoint_interval=6)
        rng = random.Random(seed)
        base = [rng.randrange(1, 40) for _ in range(20)]
        arrivals: dict[int, list[GenerateReq]] = {}
        for i in range(14):
            prompt = base[: rng.randrange(4, 20)] + [rng.randrange(1, 40) for _ in range(rng.randrange(1, 6))]
            arrivals.setdefault(rng.randrange(0, 30), []).append(greq(f"s{seed}r{i}", prompt, rng.randrange(2, 30)))
        mirror = drive(sched, worker, arrivals, seed, refuse_p=0.3, fail_p=0.03)
        total.update(mirror.stats)
        total["retractions"] += int(sched.metrics.get("hyssm_retractions_total", cause="kv"))
    assert total["reused"] > 200 and total["retractions"] > 0 and total["refused"] > 0 and total["failed"] > 0, total


def test_batch_after_a_failed_step_reuses_nothing() -> None:
    sched, worker = make(kv=256, states=8)
    sched.add_request(greq("a", [1, 2, 3], 20))
    sched.add_request(greq("b", [4, 5, 6, 7], 20))
    for _ in range(3):
        round_(sched, worker)
    batch = sched.schedule()
    assert batch is not None and all(s.kv_reuse for s in batch.reqs)
    sched.apply_result(StepResult(step=batch.step, error="boom"))
    sched.add_request(greq("c", [1, 2, 3], 4))
    batch, _ = round_(sched, worker)
    assert batch is not None and [s.kv_reuse for s in batch.reqs] == [0]


def test_refusal_rebinding_and_retraction_resend_everything() -> None:
    sched, worker = make(kv=256, states=8, disable_prompt_checkpoint=True)
    sched.add_request(greq("a", [1, 2, 3, 4], 30))
    for _ in range(3):
        round_(sched, worker)

    def reuse(refused: frozenset[str] = frozenset()) -> dict[str, tuple[int, int]]:
        batch, _ = round_(sched, worker, refused)
        assert batch is not None
        return {s.rid: (s.start_pos, s.kv_reuse) for s in batch.reqs}

    sched.add_request(greq("b", [1, 2, 3, 4, 9], 30))  # a's prompt KV is cached (no state): split at 4
    assert reuse(frozenset({"b"})) == {"a": (6, 6), "b": (0, 0)}  # b refused: back to waiting
    assert reuse() == {"a": (7, 7), "b": (0, 0)}  # b admitted again: everything
    own = list(sched.reqs["b"].kv_slots)
    # b's checkpoint at 4 re-binds its prefix to the tree's slots (a's): its own copy is freed
    assert reuse() == {"a": (8, 8), "b": (4, 0)}
    assert sched.reqs["b"].kv_slots[:4] == sched.reqs["a"].kv_slots[:4] != own
    assert reuse() == {"a": (9, 9), "b": (5, 5)}
    sched._retract(sched.reqs["a"], "kv")  # as _fit_running does when KV runs out
    assert reuse() == {"b": (6, 6), "a": (10, 0)}  # resumes from its kept progress, sends all slots
