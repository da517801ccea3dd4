"""The scheduler's state store tier against a checking fake worker: what it writes, what it loads back
into which slots, and the admission rules with loads in flight (refusals, latches, aborts, failures).

The fake worker stores what the slots hold (a KV slot's (position, token), a state slot's absorbed
tokens) under the keys the scheduler names, and its step checks every slice's prefix: a load that put
a position in the wrong slot, or a state that absorbed one token too many or too few (the last
prompt token counted twice), fails the test at the next step.
"""

from __future__ import annotations

from typing import Any

import pytest

from scheduler_proc.scheduler import Scheduler
from scheduler_proc.store_tier import StoreTier
from shared.config import ServerArgs
from shared.messages import ForwardBatch, StepResult
from shared.model_info import ModelInfo
from shared.state_store import StoreNamespace
from tests.scheduler import harness
from tests.scheduler.fake_worker import FakeWorker, SlotError
from tests.scheduler.util import ATTENTION_ONLY, HYBRID, MAMBA_ONLY, greq

BLOCK = 4
NAMESPACE = StoreNamespace(model_config="c" * 64, weights="w", dtype="float32", quantization="",
                           state_dtype="float32", tp_size=1, tp_rank=0)


class StoringWorker(FakeWorker):
    """A FakeWorker that serves ForwardBatch.store_writes / store_loads / store_clear from `store`
    (key -> the slots' contents), before the step, as worker_proc.state.store_tier does."""

    def __init__(self, store: dict[str, Any], kv: int, states: int, **kw: Any) -> None:
        super().__init__(kv, states, **kw)
        self.store = store
        self.fail_keys: set[str] = set()  # reads of these keys fail (a damaged entry)
        self.loads = 0
        self.read_steps = 0  # steps a load takes to read before it is settled (a slow store)
        self.reading: dict[int, tuple[Any, int]] = {}

    def step(self, batch: ForwardBatch, refused: frozenset[str] = frozenset()) -> StepResult:
        for w in batch.store_writes:
            for i, key in enumerate(w.kv_keys):
                self.store[key] = [self.kv[s] for s in w.kv_slots[i * BLOCK:(i + 1) * BLOCK]]
            if w.state_key:
                self.store[w.state_key] = self.state[w.state_slot]
        if batch.store_clear:
            self.store.clear()
        for load in batch.store_loads:
            self.reading[load.load_id] = (load, self.read_steps)
        settled = {}
        for load_id, (load, left) in list(self.reading.items()):
            if left > 0:
                self.reading[load_id] = (load, left - 1)
                continue
            del self.reading[load_id]
            settled[load_id] = self._load(load)
        result = super().step(batch, refused)
        result.store_done = [i for i, ok in settled.items() if ok]
        result.store_failed = [i for i, ok in settled.items() if not ok]
        return result

    def _load(self, load: Any) -> bool:
        keys = [*load.kv_keys, *([load.state_key] if load.state_key else [])]
        if any(k not in self.store or k in self.fail_keys for k in keys):
            return False
        self.loads += 1
        entries = [e for key in load.kv_keys for e in self.store[key]][load.skip:]
        if load.kv_keys and len(entries) != len(load.kv_slots):
            raise SlotError(f"load {load.load_id}: {len(entries)} positions for {len(load.kv_slots)} slots")
        for slot, entry in zip(load.kv_slots, entries, strict=False):
            self.kv[slot] = entry
        if load.state_key:
            state = self.state[load.state_slot] = self.store[load.state_key]
            if not load.kv_keys:  # no attention: the slots only stand for the positions the state absorbed
                end = len(state)
                for i, slot in enumerate(load.kv_slots):
                    pos = end - len(load.kv_slots) + i
                    self.kv[slot] = (pos, state[pos])
        return True


def make(store: dict[str, Any], model: ModelInfo = HYBRID, kv: int = 256, states: int = 8, write_back: bool = False,
         **args: Any) -> tuple[Scheduler, StoringWorker]:  # fmt: skip
    args.setdefault("chunked_prefill_size", 16)
    args.setdefault("max_prefill_tokens", 64)
    tier = StoreTier(NAMESPACE, store.__contains__, BLOCK, model.has_attention, model.has_recurrent_state,
                     write_back)
    states = states if model.has_recurrent_state else 0
    sched = Scheduler(ServerArgs(**args), model, kv, states, store=tier)
    return sched, StoringWorker(store, kv, states, vocab=model.vocab_size)


def prompt(n: int, seed: int = 1) -> list[int]:
    return [(seed * 7919 + i * 31) % 50 for i in range(n)]


def reference(p: list[int], n: int, model: ModelInfo = HYBRID) -> list[int]:
    """What the prompt gives without any store (the fake model is a function of the tokens)."""
    sched, worker = make({}, model)
    sched.res.store = None
    return harness.run(sched, worker, {0: [greq("ref", p, n)]}).tokens["ref"]


@pytest.mark.parametrize("model", [HYBRID, ATTENTION_ONLY, MAMBA_ONLY], ids=["hybrid", "attention", "mamba"])
@pytest.mark.parametrize("length", [BLOCK * 5, BLOCK * 5 + 1, BLOCK * 5 + 3])
def test_a_restarted_scheduler_loads_the_prefix_and_gives_the_same_tokens(model: ModelInfo, length: int) -> None:
    store: dict[str, Any] = {}
    p = prompt(length)
    want = reference(p, 6, model)
    sched, worker = make(store, model)
    assert harness.run(sched, worker, {0: [greq("a", p, 6)]}).tokens["a"] == want
    assert store, "nothing was written"
    sched, worker = make(store, model)  # a new process on the same store: its memory cache is empty
    log = harness.run(sched, worker, {0: [greq("b", p, 6)]})
    assert log.tokens["b"] == want
    stored = (length - 1) // BLOCK * BLOCK  # the last block end before the prompt's last token
    assert log.finals["b"].cached_tokens == stored
    assert sched.metrics.get("hyssm_state_store_loads_total", result="loaded") == 1
    assert sched.metrics.get("hyssm_cache_hit_tokens_total", tier="store") == stored


def test_a_longer_prompt_and_a_branch_load_the_shared_blocks() -> None:
    store: dict[str, Any] = {}
    base = prompt(21)
    sched, worker = make(store)
    harness.run(sched, worker, {0: [greq("a", base, 3)]})
    longer, branch = base + prompt(9, seed=2), base[:13] + prompt(10, seed=3)
    sched, worker = make(store)
    log = harness.run(sched, worker, {0: [greq("long", longer, 5)], 1: [greq("branch", branch, 5)]})
    assert log.tokens["long"] == reference(longer, 5) and log.tokens["branch"] == reference(branch, 5)
    assert log.finals["long"].cached_tokens == 20
    # the branch diverges inside the stored prefix, past which the store has no state: the memory match
    # (the branch point of the longer prompt) or a computed prefix serves it; either way it is exact
    assert log.finals["branch"].cached_tokens <= 13


def test_a_load_that_fails_is_computed_instead() -> None:
    store: dict[str, Any] = {}
    p = prompt(30)
    want = reference(p, 4)
    sched, worker = make(store)
    harness.run(sched, worker, {0: [greq("a", p, 4)]})
    sched, worker = make(store)
    worker.fail_keys = set(store)  # every entry damaged
    log = harness.run(sched, worker, {0: [greq("b", p, 4)]})
    assert log.tokens["b"] == want and log.finals["b"].cached_tokens == 0
    assert sched.metrics.get("hyssm_state_store_loads_total", result="failed") == 1


def test_loads_with_a_full_state_pool_are_refused_retried_and_never_latch() -> None:
    """Two state slots in all: a load needs one, the request then its own copy; requests sharing the
    stored prefix arrive together and must all finish, exactly, with nothing leaked."""
    store: dict[str, Any] = {}
    p = prompt(24)
    sched, worker = make(store, states=3, max_running_requests=1)
    harness.run(sched, worker, {0: [greq("a", p, 2)]})
    sched, worker = make(store, states=3, max_running_requests=1)
    prompts = {f"r{i}": p + prompt(3 + i, seed=10 + i) for i in range(6)}
    log = harness.run(sched, worker, {0: [greq(rid, q, 3) for rid, q in prompts.items()]})
    for rid, q in prompts.items():
        assert log.tokens[rid] == reference(q, 3), rid
    assert sched.metrics.get("hyssm_state_store_loads_total", result="loaded") >= 1
    assert not sched.retry.batch_is_full or not sched.has_work
    server = sched.info().server
    assert server.state_free + server.state_cached == server.state_capacity


def test_an_abort_while_loading_ends_the_request_and_frees_the_load() -> None:
    store: dict[str, Any] = {}
    p = prompt(40)
    sched, worker = make(store)
    harness.run(sched, worker, {0: [greq("a", p, 2)]})
    sched, worker = make(store)
    sched.add_request(greq("b", p, 4))
    batch = sched.schedule()
    assert batch is not None and batch.store_loads and not batch.reqs
    assert sched.reqs["b"].status.value == "loading"
    assert sched.abort("b") == []  # its load is in flight: it ends when the result is applied
    outs = sched.apply_result(worker.step(batch))
    assert [(o.rid, o.finish_reason) for o in outs] == [("b", "abort")]
    sched.check_integrity()
    assert not sched.has_work
    # the loaded prefix stays in the memory cache for the next request
    log = harness.run(sched, worker, {0: [greq("c", p, 4)]})
    assert log.tokens["c"] == reference(p, 4) and log.finals["c"].cached_tokens == 36


def test_flush_with_the_store_empties_it_and_writes_start_again() -> None:
    store: dict[str, Any] = {}
    p = prompt(30)
    sched, worker = make(store)
    harness.run(sched, worker, {0: [greq("a", p, 2)]})
    assert store and sched.flush_cache(include_store=True)
    batch = sched.schedule()
    assert batch is not None and batch.store_clear
    sched.apply_result(worker.step(batch))
    assert not store
    harness.run(sched, worker, {0: [greq("b", p, 2)]})
    assert store, "blocks written before the clear were not written again"


def test_a_write_is_sent_even_when_nothing_else_runs() -> None:
    """Attention only: the prompt's blocks are queued when its prefill ends; a request that finishes in
    that step leaves no batch to carry them, so one is sent for the writes alone."""
    store: dict[str, Any] = {}
    sched, worker = make(store, ATTENTION_ONLY)
    harness.run(sched, worker, {0: [greq("a", prompt(17), 1)]})
    assert len(store) == 4


@pytest.mark.parametrize("model", [HYBRID, ATTENTION_ONLY], ids=["hybrid", "attention"])
def test_write_back_stores_what_eviction_drops_and_everything_at_shutdown(model: ModelInfo) -> None:
    store: dict[str, Any] = {}
    prompts = {f"r{i}": prompt(22, seed=20 + i) for i in range(6)}
    sched, worker = make(store, model, kv=64, states=4, write_back=True, max_running_requests=1)
    harness.run(sched, worker, {i: [greq(rid, q, 2)] for i, (rid, q) in enumerate(prompts.items())})
    evicted = dict(store)
    assert evicted, "eviction under write-back stored nothing"
    batch = sched.write_back_batch()
    assert batch is not None and batch.store_writes and not batch.reqs
    sched.apply_result(worker.step(batch))
    sched.check_integrity()
    assert len(store) > len(evicted)
    sched, worker = make(store, model)
    log = harness.run(sched, worker, {0: [greq(f"again-{rid}", q, 2) for rid, q in prompts.items()]})
    for rid, q in prompts.items():
        assert log.tokens[f"again-{rid}"] == reference(q, 2, model), rid
    assert sched.metrics.get("hyssm_state_store_loads_total", result="loaded") == len(prompts)


def test_a_slow_load_lets_running_requests_decode_and_polls_when_nothing_else_runs() -> None:
    store: dict[str, Any] = {}
    p, other = prompt(40), prompt(9, seed=4)
    sched, worker = make(store)
    harness.run(sched, worker, {0: [greq("a", p, 2)]})
    sched, worker = make(store)
    worker.read_steps = 5
    log = harness.run(sched, worker, {0: [greq("decoding", other, 12)], 2: [greq("b", p, 4)]}, keep_batches=True)
    assert log.tokens["b"] == reference(p, 4) and log.finals["b"].cached_tokens == 36
    assert log.tokens["decoding"] == reference(other, 12)
    loads = [i for i, b in enumerate(log.batches) if b.store_loads]
    assert len(loads) == 1
    # while the load was read the other request decoded, one token a step
    pending = log.batches[loads[0]:loads[0] + 5]
    assert all(any(s.rid == "decoding" for s in b.reqs) for b in pending)


def test_an_abort_of_a_slow_load_waits_for_it_to_settle() -> None:
    store: dict[str, Any] = {}
    p = prompt(40)
    sched, worker = make(store)
    harness.run(sched, worker, {0: [greq("a", p, 2)]})
    sched, worker = make(store)
    worker.read_steps = 3
    sched.add_request(greq("b", p, 4))
    outs: list[Any] = []
    for rnd in range(10):
        batch = sched.schedule()
        sched.check_integrity()
        if batch is None:
            break
        assert not batch.reqs  # polls: nothing else runs
        if rnd == 1:
            assert sched.abort("b") == []
        outs += sched.apply_result(worker.step(batch))
        sched.check_integrity()
    assert [(o.rid, o.finish_reason) for o in outs] == [("b", "abort")]
    assert not sched.has_work and not worker.reading


def test_a_load_refused_for_room_is_tried_again_once_room_comes_back() -> None:
    store: dict[str, Any] = {}
    p = prompt(40)
    sched, worker = make(store)
    harness.run(sched, worker, {0: [greq("a", p, 2)]})
    sched, worker = make(store, kv=56)
    log = harness.run(sched, worker, {0: [greq("busy", prompt(8, seed=5), 30)], 1: [greq("b", p, 4)]})
    assert sched.metrics.get("hyssm_admission_refusals_total", reason="kv") >= 1
    assert sched.metrics.get("hyssm_state_store_loads_total", result="loaded") == 1
    assert log.tokens["b"] == reference(p, 4) and log.finals["b"].cached_tokens == 36
