"""LoRA adapters in the scheduler (scheduler_proc/lora_slots.py) against the checking fake worker: slots
are assigned and evicted least recently used, a request whose adapter finds no slot waits like a memory
refusal and is admitted as soon as a slot is unpinned, an unloaded adapter's requests finish under it, and
the cache never serves one adapter's prefix to another (keyed by uid, not by name)."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest

from scheduler_proc.scheduler import Scheduler
from shared.messages import GenerateReq, LoraAdapter, TokenOut
from tests.scheduler.fake_worker import TAG, FakeWorker, SlotError, tag
from tests.scheduler.harness import run
from tests.scheduler.util import ATTENTION_ONLY, greq, make, rids, round_

PROMPT = list(range(1, 41))
LONGER = [*PROMPT, 3, 4]  # PROMPT extended: the cached prompt-end state of PROMPT serves it


def adapter(name: str, uid: str | None = None) -> LoraAdapter:
    return LoraAdapter(name=name, path=f"/adapters/{name}", uid=uid or f"uid-{name}", rank=8, scaling=2.0,
                       targets=("q_proj", "v_proj"))


def lreq(rid: str, lora: str, prompt: list[int] = PROMPT, max_new: int = 4) -> GenerateReq:
    return msgspec.structs.replace(greq(rid, prompt, max_new), lora=lora)


def setup(*names: str, slots: int = 2, **args: Any) -> tuple[Scheduler, FakeWorker]:
    sched, worker = make(enable_lora=True, max_loras_per_batch=slots, **args)
    for name in names:
        assert sched.lora.load(adapter(name)) == ""
    return sched, worker


def submit(sched: Scheduler, worker: FakeWorker, req: GenerateReq) -> list[TokenOut]:
    use = sched.lora.lookup(req.lora)
    worker.expect[req.rid] = use.adapter.uid if use is not None else ""
    return sched.add_request(req)


def drain(sched: Scheduler, worker: FakeWorker, limit: int = 200) -> dict[str, TokenOut]:
    finals: dict[str, TokenOut] = {}
    for _ in range(limit):
        if not sched.has_work:
            return finals
        _, outs = round_(sched, worker)
        finals.update({o.rid: o for o in outs if o.finished})
    raise AssertionError("not drained")


def output(sched: Scheduler, worker: FakeWorker, req: GenerateReq) -> list[int]:
    submit(sched, worker, req)
    log = run(sched, worker, {})
    return log.tokens[req.rid]


def test_slots_are_assigned_then_the_least_recently_used_is_evicted() -> None:
    sched, worker = setup("A", "B", "C")
    loads: list[tuple[int, str]] = []
    for rid, name in [("a", "A"), ("b", "B"), ("a2", "A"), ("c", "C")]:
        submit(sched, worker, lreq(rid, name))
        while sched.has_work:
            batch, _ = round_(sched, worker)
            assert batch is not None
            loads += [(load.slot, load.adapter.name) for load in batch.lora_loads]
    # A and B take the free slots; A again finds its slot; C evicts B, the least recently used
    assert loads == [(1, "A"), (2, "B"), (2, "C")]
    assert worker.lora == {1: "uid-A", 2: "uid-C"}


def test_a_request_runs_under_its_slot_and_reads_its_real_first_token() -> None:
    sched, worker = setup("A")
    submit(sched, worker, lreq("a", "A"))
    batch, _ = round_(sched, worker)
    assert batch is not None
    (s,) = batch.reqs
    assert s.lora_slot == 1 and s.input_ids[:3] == PROMPT[:3]  # the model reads the real tokens
    assert sched.reqs["a"].tokens[0] < 0  # the cache keys the first position by the adapter
    assert sched.reqs["a"].model_ids(0, len(PROMPT)) == PROMPT
    drain(sched, worker)


def test_the_fake_worker_catches_a_slice_under_the_wrong_adapter() -> None:
    sched, worker = setup("A", "B")
    submit(sched, worker, lreq("a", "A"))
    worker.expect["a"] = "uid-B"
    with pytest.raises(SlotError):
        round_(sched, worker)


@pytest.mark.parametrize("args", [{"model": ATTENTION_ONLY}, {"disable_radix_cache": True}])
def test_no_free_slot_is_a_refusal_until_a_slot_unpins_without_a_stale_latch(args: dict[str, Any]) -> None:
    """With one slot pinned by A's running request, B's request is refused ("lora_slot") and latched; the
    round after A's request leaves the running set, B is admitted. Run where the latch is only cleared by a
    change of the running set (no per-round clearing), where a stale latch would show."""
    sched, worker = setup("A", "B", slots=1, **args)
    assert not sched.retry.clear_every_round
    submit(sched, worker, lreq("a", "A", max_new=6))
    round_(sched, worker)
    submit(sched, worker, lreq("b", "B"))
    submit(sched, worker, lreq("c", ""))  # behind the refused head: no overtaking
    finished_a = False
    for _ in range(20):
        batch, outs = round_(sched, worker)
        if finished_a:
            assert "b" in rids(batch), "B's request stayed queued after A's slot was unpinned"
            break
        assert rids(batch) == ["a"]
        assert sched.retry.batch_is_full
        finished_a = any(o.rid == "a" and o.finished for o in outs)
    else:
        raise AssertionError("A's request never finished")
    assert sched.metrics.get("hyssm_admission_refusals_total", reason="lora_slot") >= 1
    assert batch is not None and [(load.slot, load.adapter.name) for load in batch.lora_loads] == [(1, "B")]
    finals = drain(sched, worker)
    assert {"b", "c"} <= set(finals)


def test_unload_lets_running_requests_finish_and_frees_the_slot_after_the_last() -> None:
    sched, worker = setup("A")
    alone = output(*setup("A"), lreq("a", "A", max_new=8))
    submit(sched, worker, lreq("a", "A", max_new=8))
    submit(sched, worker, lreq("w", "A", max_new=2))
    _, first = round_(sched, worker)
    assert sched.lora.unload("A") == ""
    (out,) = sched.add_request(lreq("late", "A"))
    assert out.rejected and "unknown LoRA adapter 'A'" in (out.error or "")
    assert sched.lora.load(adapter("A", uid="uid-A2")) == ""  # the name is free again at once
    submit(sched, worker, lreq("new", "A", max_new=2))
    log = run(sched, worker, {})
    started = [t for o in first if o.rid == "a" for t in o.token_ids]
    assert started + log.tokens["a"] == alone  # finished under the adapter it started with
    assert all(log.finals[rid].finish_reason == "length" for rid in ("a", "w", "new"))
    assert not sched.lora.draining and worker.lora[1] in ("uid-A", "uid-A2")
    assert [u.adapter.uid for u in sched.lora.slots if u is not None] == ["uid-A2"]


def test_unloading_an_idle_adapter_frees_its_slot_at_once() -> None:
    sched, worker = setup("A")
    output(sched, worker, lreq("a", "A"))
    assert sched.lora.slots[1] is not None
    assert sched.lora.unload("A") == "" and sched.lora.slots[1] is None
    assert "not loaded" in sched.lora.unload("A")
    sched.check_integrity()


def test_the_cache_never_serves_one_adapters_prefix_to_another() -> None:
    """The same prompt under A, then B, then the base: B and the base compute what a fresh server computes
    (their own adapter's outputs, nothing cached); under A again it hits A's prefix."""
    sched, worker = setup("A", "B")
    fresh = {name: output(*setup("A", "B"), lreq(name or "base", name, LONGER)) for name in ("A", "B", "")}
    output(sched, worker, lreq("a1", "A"))
    for rid, name in [("b", "B"), ("base", ""), ("a2", "A")]:
        submit(sched, worker, lreq(rid, name, LONGER))
        log = run(sched, worker, {})
        assert log.tokens[rid] == fresh[name]
        hit = log.finals[rid].cached_tokens
        assert hit == len(PROMPT) if name == "A" else hit == 0, f"{rid}: {hit} tokens cached"
    assert len({tuple(v) for v in fresh.values()}) == 3  # outputs depend on the adapter


def test_the_cache_is_keyed_by_uid_not_by_name() -> None:
    sched, worker = setup()
    sched.lora.load(adapter("A", uid="same"))
    sched.lora.load(adapter("alias", uid="same"))
    sched.lora.load(adapter("other", uid="changed"))
    output(sched, worker, lreq("a", "A"))
    other, other_worker = setup()
    other.lora.load(adapter("A", uid="same"))
    fresh = output(other, other_worker, lreq("a", "A", LONGER))
    submit(sched, worker, lreq("alias", "alias", LONGER))
    submit(sched, worker, lreq("other", "other", LONGER))
    log = run(sched, worker, {})
    assert log.tokens["alias"] == fresh and log.finals["alias"].cached_tokens == len(PROMPT)
    assert log.finals["other"].cached_tokens == 0


def test_requests_naming_no_known_adapter_are_rejected() -> None:
    sched, _ = setup("A")
    (out,) = sched.add_request(lreq("x", "missing"))
    assert out.rejected and "unknown LoRA adapter 'missing'" in (out.error or "")
    off, _ = make()
    (out,) = off.add_request(lreq("y", "A"))
    assert out.rejected and "--enable-lora" in (out.error or "")
    assert "--enable-lora" in off.lora.load(adapter("A"))
    assert "loaded already" in sched.lora.load(adapter("A"))
    sched.check_integrity()


def test_aborting_waiting_requests_releases_their_adapter() -> None:
    sched, worker = setup("A", "B", slots=1)
    submit(sched, worker, lreq("a", "A", max_new=6))
    round_(sched, worker)
    submit(sched, worker, lreq("b", "B"))
    round_(sched, worker)
    sched.lora.unload("B")
    assert sched.lora.draining  # its waiting request still names it
    sched.abort("b")
    assert not sched.lora.draining
    sched.check_integrity()
    drain(sched, worker)


def expected_output(worker: FakeWorker, uid: str, prompt: list[int], max_new: int) -> list[int]:
    """What the fake worker's greedy model outputs for `prompt` under the adapter `uid`, computed directly."""
    t = tag(uid) * TAG
    seq = tuple(tok + t for tok in prompt)
    out = []
    for _ in range(max_new):
        tok = worker.next_token(seq)
        out.append(tok)
        seq += (tok + t,)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_random_mix_of_adapters_under_memory_pressure(seed: int) -> None:
    """Many requests over three adapters and the base with two slots, shared prefixes and a small KV pool
    (retractions): every request gets exactly its own adapter's output, and the checks hold every round."""
    rng = random.Random(seed)
    sched, worker = setup("A", "B", "C", kv=72, states=6, chunked_prefill_size=16)
    stems = [[rng.randrange(1, 50) for _ in range(12)] for _ in range(3)]
    arrivals: dict[int, list[GenerateReq]] = {}
    expected: dict[str, list[int]] = {}
    for i in range(24):
        name = rng.choice(["A", "B", "C", ""])
        prompt = rng.choice(stems) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 6))]
        req = lreq(f"r{i}", name, prompt, max_new=rng.randrange(1, 16))
        arrivals.setdefault(rng.randrange(0, 12), []).append(req)
        worker.expect[req.rid] = f"uid-{name}" if name else ""
        expected[req.rid] = expected_output(worker, worker.expect[req.rid], prompt, req.sampling.max_new_tokens)
    log = run(sched, worker, arrivals)
    assert {rid: log.tokens.get(rid, []) for rid in expected} == expected
    assert all(u.running == 0 and u.requests == 0 for u in sched.lora.by_name.values())
