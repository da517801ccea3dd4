"""Speculative decoding in the scheduler (scheduler_proc/drafting.py): n-gram drafts from the
request's own tokens, verify slices within the free resources only, and outputs that do not depend
on drafting; the FakeWorker checks every slot the scheduler hands it and verifies drafts like a
greedy model."""

from __future__ import annotations

import pytest

from scheduler_proc.drafting import (
    EXPLORE_EVERY,
    MAX_BACKOFF,
    MAX_EXPLORE_EVERY,
    MIN_ROUNDS,
    DraftingGain,
    NgramDrafter,
)
from tests.scheduler import harness
from tests.scheduler.fake_worker import FakeWorker
from tests.scheduler.util import MAMBA_ONLY, greq, make


class CyclingWorker(FakeWorker):
    """A 'model' whose output repeats: the next token continues the period-`period` pattern of the
    prompt's first tokens (so prompt lookup drafts right), except at every `miss`-th position."""

    def __init__(self, *args: object, period: int = 5, miss: int = 7, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.period, self.miss = period, miss

    def next_token(self, seq: tuple[int, ...]) -> int:
        if len(seq) % self.miss == 0:
            return (sum(seq[-3:]) + 11) % self.vocab
        return seq[len(seq) - self.period]


class GuessingWorker(CyclingWorker):
    """A CyclingWorker whose 'MTP layers' guess its own continuation, wrong from the `wrong_from`-th
    guess on."""

    def __init__(self, *args: object, wrong_from: int = 3, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.wrong_from = wrong_from

    def guess(self, seq: tuple[int, ...], k: int) -> list[int]:
        out: list[int] = []
        for i in range(k):
            tok = self.next_token(seq)
            out.append(tok if i < self.wrong_from else (tok + 1) % self.vocab)
            seq = seq + (tok,)
        return out


def test_nextn_verifies_the_guesses_made_after_the_newest_token() -> None:
    """NEXTN: every sampling slice asks for guesses, the next round's verify slice carries the ones made
    in the step that produced the request's newest token, and outputs do not depend on drafting."""
    prompts = {f"r{i}": [(3 * i + j) % 50 for j in range(5)] * 3 for i in range(4)}
    plain, _ = make(kv=512, states=16)
    ref = harness.run(plain, CyclingWorker(512, 16), {0: [greq(rid, p, 30) for rid, p in prompts.items()]})
    spec, _ = make(kv=512, states=16, speculative_algorithm="NEXTN", speculative_num_draft_tokens=4)
    log = harness.run(spec, GuessingWorker(512, 16, wrong_from=3),
                      {0: [greq(rid, p, 30) for rid, p in prompts.items()]})  # fmt: skip
    assert log.tokens == ref.tokens
    m = spec.metrics
    steps, accepted = m.get("hyssm_spec_verify_steps_total"), m.get("hyssm_spec_accepted_tokens_total")
    assert steps > 0 and accepted / steps > 1.5, (steps, accepted)  # right up to the third guess, or a miss
    assert m.get("hyssm_spec_draft_tokens_total") <= 4 * steps
    assert log.rounds < ref.rounds / 1.8


def test_drafter_continues_the_longest_most_recent_match() -> None:
    d = NgramDrafter(1, 4)
    toks = [1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3]
    assert d.propose(toks, 3) == [7, 5, 2]  # [2, 3] occurs twice before; the later one is followed by 7, 5, 2
    assert d.propose(toks + [8], 3) == []  # 8 never occurred before
    assert NgramDrafter(3, 4).propose([4, 2, 3, 1, 5, 2, 3], 2) == []  # only a 2-token match: below the window
    assert NgramDrafter(1, 4).propose([6, 6, 6], 4) == [6]  # nothing longer follows an earlier 6
    assert NgramDrafter(1, 3).propose([6] * 9, 4) == [6] * 4  # a run: the occurrence a whole draft follows


def test_drafter_sits_out_longer_after_each_failed_verify_and_resets_on_success() -> None:
    d = NgramDrafter(1, 4)
    pauses = []
    for _ in range(6):
        d.record(0)
        n = 0
        while not d.ready():
            n += 1
        pauses.append(n)
    assert pauses == [1, 2, 4, 8, 16, 16] and MAX_BACKOFF == 16
    d.record(2)
    d.record(0)
    assert not d.ready() and d.ready()  # back to a pause of one round


@pytest.mark.parametrize("model", ["hybrid", "mamba_only"])
def test_outputs_do_not_depend_on_drafting(model: str) -> None:
    kw = {"model": MAMBA_ONLY} if model == "mamba_only" else {}
    prompts = {f"r{i}": [(3 * i + j) % 50 for j in range(5)] * 3 for i in range(6)}
    reqs = [greq(rid, p, 40) for rid, p in prompts.items()]
    plain, _ = make(kv=512, states=16, **kw)
    ref = harness.run(plain, CyclingWorker(512, 16), {0: reqs})
    spec, _ = make(kv=512, states=16, speculative_algorithm="NGRAM", speculative_num_draft_tokens=4, **kw)
    log = harness.run(spec, CyclingWorker(512, 16), {0: [greq(r.rid, r.input_ids, 40) for r in reqs]})
    assert log.tokens == ref.tokens
    m = spec.metrics
    steps, accepted = m.get("hyssm_spec_verify_steps_total"), m.get("hyssm_spec_accepted_tokens_total")
    assert steps > 0 and accepted / steps > 2.0  # repeating text: most drafts are right
    assert log.rounds < ref.rounds / 2
    assert spec.res.state_alloc.num_free == spec.res.state_alloc.capacity - spec.cache.states_total


def test_no_free_state_slot_means_no_drafts_not_a_failure() -> None:
    """Two running requests take both state slots: nothing can back a verify step up (a running
    request's slot is never lent), so they decode one token a step, with the same output."""
    reqs = [greq(f"r{i}", [1, 2, 3, 4, 5] * 3, 12) for i in range(2)]
    sched, _ = make(kv=256, states=2, speculative_algorithm="NGRAM", disable_radix_cache=True)
    log = harness.run(sched, CyclingWorker(256, 2), {0: reqs}, keep_batches=True)
    plain, _ = make(kv=256, states=2, disable_radix_cache=True)
    again = [greq(r.rid, r.input_ids, 12) for r in reqs]
    assert log.tokens == harness.run(plain, CyclingWorker(256, 2), {0: again}).tokens
    assert not any(s.drafts for b in log.batches for s in b.reqs)


def test_drafts_stop_at_max_new_tokens_and_logprob_requests_take_them() -> None:
    sched, _ = make(kv=256, states=8, speculative_algorithm="NGRAM", speculative_num_draft_tokens=8)
    reqs = [greq("short", [1, 2, 3, 4, 5] * 3, 6), greq("lp", [1, 2, 3, 4, 5] * 3, 10, logprobs=True)]
    log = harness.run(sched, CyclingWorker(256, 8), {0: reqs}, keep_batches=True)
    assert len(log.tokens["short"]) == 6 and len(log.tokens["lp"]) == 10
    assert any(s.drafts for b in log.batches for s in b.reqs if s.rid == "lp")
    short = [s for b in log.batches for s in b.reqs if s.rid == "short" and s.drafts]
    assert short and all(s.output_len + s.drafts + 1 <= 6 for s in short)


def test_a_verify_steps_logprobs_go_out_with_its_tokens_or_end_the_request() -> None:
    """A verify step emits its accepted drafts and the next token with one logprob each; a result
    whose logprobs do not cover exactly those tokens ends the request with an error, not a mismatch."""
    for wrong in (False, True):
        sched, _ = make(kv=256, states=8, speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)
        worker = CyclingWorker(256, 8)
        sched.add_request(greq("lp", [1, 2, 3, 4, 5] * 3, 12, logprobs=True))
        got: list[tuple[int, float]] = []
        while sched.has_work:
            batch = sched.schedule()
            assert batch is not None
            result = worker.step(batch)
            drafted = {s.rid: s.drafts for s in batch.reqs}
            if result.next_tokens:
                n = result.accepted.get("lp", 0) + 1
                result.logprobs = {"lp": [-0.5 * (i + 1) for i in range(n + (wrong and drafted["lp"] > 0))]}
            for out in sched.apply_result(result):
                got.extend(zip(out.token_ids, out.logprobs or [], strict=not out.error))
                if out.finished:
                    assert (out.finish_reason == "error") == wrong, out
        if not wrong:
            assert len(got) == 12 and any(lp < -0.5 for _, lp in got)  # a multi-token step's second logprob


def test_memory_pressure_retractions_and_prefix_hits_keep_outputs() -> None:
    """A KV pool too small for every request at once: retractions, refusals and prefix-cache hits
    happen with drafts in flight, and every request still gets the output it gets without drafts."""
    from scheduler_proc.scheduler import SchedulerTuning

    prompts = {f"p{i}": ([1, 2, 3, 4, 5] * 4)[: 12 + i] for i in range(5)}
    tuning = SchedulerTuning(init_ratio=0.0, min_ratio=0.0)

    def serve(**args: object) -> tuple[dict[str, list[int]], object]:
        sched, _ = make(kv=70, states=8, chunked_prefill_size=8, max_prefill_tokens=16, tuning=tuning, **args)
        reqs = [greq(rid, p, 24) for rid, p in prompts.items()]
        return harness.run(sched, CyclingWorker(70, 8), {0: reqs[:3], 2: reqs[3:]}).tokens, sched

    plain, _ = serve()
    spec_tokens, spec = serve(speculative_algorithm="NGRAM", speculative_num_draft_tokens=3)
    assert spec_tokens == plain
    m = spec.metrics  # type: ignore[attr-defined]
    assert m.get("hyssm_retractions_total", cause="kv") > 0 and m.get("hyssm_spec_accepted_tokens_total") > 0
    assert m.get("hyssm_prefix_cache_hit_tokens_total", kind="state") > 0


def test_a_cache_full_of_states_still_lends_a_backup() -> None:
    """Finished requests leave their states in the cache until no slot is free; a later request still
    drafts (the backup is evicted from the cache like any allocation) and its output is unchanged."""
    sched, _ = make(kv=512, states=6, speculative_algorithm="NGRAM")
    worker = CyclingWorker(512, 6)
    for i in range(6):
        harness.run(sched, worker, {0: [greq(f"w{i}", [40 + i, 41, 42, 43, 44, 45], 3)]})
    assert sched.res.state_alloc.num_free <= 1  # admission takes it: every backup comes from the cache
    steps = sched.metrics.get("hyssm_spec_verify_steps_total")
    log = harness.run(sched, worker, {0: [greq("late", [1, 2, 3, 4, 5] * 3, 20)]})
    plain, _ = make(kv=512, states=6)
    assert log.tokens == harness.run(plain, CyclingWorker(512, 6), {0: [greq("late", [1, 2, 3, 4, 5] * 3, 20)]}).tokens
    assert sched.metrics.get("hyssm_spec_verify_steps_total") > steps


def test_drafting_runs_at_the_batch_sizes_where_it_was_measured_faster() -> None:
    """Measured per batch-size bucket: each mode gets MIN_ROUNDS rounds first; then where verify rounds
    emit clearly fewer tokens per second than plain ones drafting stops but for exploring rounds after
    EXPLORE_EVERY, 2 * EXPLORE_EVERY, ... rounds (at most MAX_EXPLORE_EVERY apart), and where they emit
    more it runs but for such plain rounds; a choice that changes explores after EXPLORE_EVERY again."""
    gain = DraftingGain()
    modes = []
    for _ in range(2 * MIN_ROUNDS):
        modes.append(gain.wants(32))
        gain.observe(32, modes[-1], 64 if modes[-1] else 80, 1.0)  # 64 tok/s drafting, 80 without
        gain.observe(1, modes[-1], 4 if modes[-1] else 1, 0.1 if modes[-1] else 0.07)  # 40 vs 14 tok/s
    assert sorted(modes) == [False] * MIN_ROUNDS + [True] * MIN_ROUNDS
    gain.observe(32, False, 80, 1.0)
    big = [gain.wants(32) for _ in range(3 * EXPLORE_EVERY)]
    alone = [gain.wants(1) for _ in range(3 * EXPLORE_EVERY)]
    explored = [i + 1 for i, m in enumerate(big) if m]
    assert explored == [EXPLORE_EVERY, 3 * EXPLORE_EVERY] and sum(alone) == 3 * EXPLORE_EVERY - 2
    later = [gain.wants(32) for _ in range(10 * MAX_EXPLORE_EVERY)]
    assert 10 <= sum(later) <= 12  # at most one exploring round in MAX_EXPLORE_EVERY once the interval is there
    for _ in range(20):  # the load changed: drafting now pays at 32 too
        gain.observe(32, True, 32 * 4, 1.0)
    assert sum(gain.wants(32) for _ in range(EXPLORE_EVERY)) == EXPLORE_EVERY - 1
