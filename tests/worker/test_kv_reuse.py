"""ReqSlice.kv_reuse on the worker: slices that send only their new KV slots (the rest from the
runner's mirror of the previous batch) give exactly the logits of full-list slices; a reuse the mirror
cannot serve fails the step before anything is written; refused and failed steps drop what they must."""

from __future__ import annotations

import msgspec
import pytest
import torch

from shared.messages import CopyOp, ReqSlice
from tests.model_driver import forward_all_logits
from tests.worker.util import GREEDY, batch, req, runner
from worker_proc.model.kv_mirror import KVSlotMirror
from worker_proc.runtime.runner import ModelRunner

PROMPT_A = [5, 9, 14, 3, 77, 21, 8, 40, 11, 2]
PROMPT_B = [17, 4, 250, 6, 33]
KV_A = list(range(1, 31))
KV_B = list(range(41, 71))


def delta(sl: ReqSlice, reuse: int) -> ReqSlice:
    return msgspec.structs.replace(sl, kv_slots=sl.kv_slots[reuse:], kv_reuse=reuse)


def run_pair(r: ModelRunner, deltas: bool) -> list[dict[str, torch.Tensor]]:
    """a: a 6-token chunk, a 4-token chunk, decodes; b joins at step 1 and decodes: logits per step."""
    out = [forward_all_logits(r, batch(0, [req("a", PROMPT_A[:6], 0, KV_A[:6], 1, sample=False)], clears=[1]))]
    slices = [req("a", PROMPT_A[6:], 6, KV_A[:10], 1), req("b", PROMPT_B, 0, KV_B[:5], 2)]
    reuse = {"a": 6, "b": 0}
    tok = {"a": 7, "b": 99}
    for step in range(1, 6):
        sent = [delta(s, reuse[s.rid]) if deltas else s for s in slices]
        out.append(forward_all_logits(r, batch(step, sent, clears=[2] if step == 1 else [])))
        nxt = []
        for s in slices:
            end = s.start_pos + len(s.input_ids)
            kv = KV_A if s.rid == "a" else KV_B
            nxt.append(req(s.rid, [tok[s.rid] + step], end, kv[: end + 1], s.state_slot))
            reuse[s.rid] = end
        slices = nxt
    return out


@pytest.mark.parametrize("name", ["rope_moe", "nope_groups2"])
def test_delta_steps_equal_full_list_steps(name: str) -> None:
    full, part = runner(name), runner(name)
    want, got = run_pair(full, deltas=False), run_pair(part, deltas=True)
    for w, g in zip(want, got, strict=True):
        assert w.keys() == g.keys()
        for rid in w:
            assert torch.equal(w[rid], g[rid]), rid
    for pool in ("k", "v", "conv", "ssm"):
        assert torch.equal(getattr(full.pools, pool), getattr(part.pools, pool)), pool
    held = part.kv_mirror.get("a")
    assert held is not None and held.tolist() == KV_A[:14] and len(part.kv_mirror) == 2
    part.check_integrity()


def test_step_with_deltas_samples_like_full_lists() -> None:
    full, part = runner("rope_moe"), runner("rope_moe")
    first = req("a", PROMPT_A, 0, KV_A[:10], 1)
    toks = [full.step(batch(0, [first], clears=[1])).next_tokens["a"]]
    assert part.step(batch(0, [first], clears=[1])).next_tokens["a"] == toks[0]
    for step in range(1, 4):
        end = 10 + step - 1
        sl = req("a", [toks[-1]], end, KV_A[: end + 1], 1, sampling=GREEDY, output_len=step)
        want = full.step(batch(step, [sl])).next_tokens["a"]
        assert part.step(batch(step, [delta(sl, end)])).next_tokens["a"] == want
        toks.append(want)


def _prefilled() -> ModelRunner:
    r = runner("rope_moe")
    r.step(batch(0, [req("a", PROMPT_A[:5], 0, KV_A[:5], 1), req("b", PROMPT_B, 0, KV_B[:5], 2)], clears=[1, 2]))
    return r


def _snapshot(r: ModelRunner) -> list[torch.Tensor]:
    return [getattr(r.pools, p).clone() for p in ("k", "v", "conv", "ssm")]


@pytest.mark.parametrize(
    ("step", "reuse", "why"),
    [(1, 6, "holds 5"), (2, 5, "holds 0"), (1, 5, "kv_reuse 5 \\+ 2 kv_slots")],
)
def test_unservable_reuse_raises_before_writing(step: int, reuse: int, why: str) -> None:
    """Too many reused slots, a batch that is not the next one, a wrong slot count: ValueError, with
    the state ops of the batch not applied, and the mirror emptied (the step failed)."""
    r = _prefilled()
    before = _snapshot(r)
    n_new = 6 - reuse if why != "kv_reuse 5 \\+ 2 kv_slots" else 2
    bad = ReqSlice(rid="a", input_ids=[PROMPT_A[5]], start_pos=5, kv_slots=KV_A[6 - n_new : 6], state_slot=1,
                   sample=True, sampling=GREEDY, kv_reuse=reuse)  # fmt: skip
    with pytest.raises(ValueError, match=why):
        r.step(batch(step, [bad], copies=[CopyOp(1, 3)], clears=[2]))
    for was, now in zip(before, _snapshot(r), strict=True):
        assert torch.equal(was, now)
    assert len(r.kv_mirror) == 0
    r.check_integrity()


def test_refused_requests_are_dropped_from_the_mirror() -> None:
    r = _prefilled()
    step = batch(1, [delta(req("a", [PROMPT_A[5]], 5, KV_A[:6], 1), 5), req("c", [3, 4], 0, [80, 81], 4)],
                 copies=[CopyOp(2, 4, "c")])  # fmt: skip
    res = r.step(step, refused=frozenset({"c"}))
    assert res.refused == ["c"] and set(res.next_tokens) == {"a"}
    assert r.kv_mirror.get("c") is None and r.kv_mirror.get("b") is None  # b did not run in step 1
    held = r.kv_mirror.get("a")
    assert held is not None and held.tolist() == KV_A[:6]
    with pytest.raises(ValueError, match="request b: kv_reuse 5 but the worker holds 0"):
        r.step(batch(2, [delta(req("b", [7], 5, KV_B[:6], 2), 5)]))


def test_failed_step_empties_the_mirror(monkeypatch: pytest.MonkeyPatch) -> None:
    r = _prefilled()

    def broken(*args: object, **kw: object) -> torch.Tensor:
        raise RuntimeError("device fault")

    monkeypatch.setattr(r.model, "forward_step", broken)
    with pytest.raises(RuntimeError, match="device fault"):
        r.step(batch(1, [delta(req("a", [PROMPT_A[5]], 5, KV_A[:6], 1), 5)]))
    assert len(r.kv_mirror) == 0
    monkeypatch.undo()
    with pytest.raises(ValueError, match="holds 0"):
        r.step(batch(2, [delta(req("a", [PROMPT_A[6]], 6, KV_A[:7], 1), 6)]))
    res = r.step(batch(3, [req("a", [PROMPT_A[6]], 6, KV_A[:7], 1)]))  # a full list is always served
    assert set(res.next_tokens) == {"a"}


def test_mirror_commit_and_resolve() -> None:
    m = KVSlotMirror()
    cpu = torch.device("cpu")
    first = [req("x", [1, 2], 0, [4, 5], 1), req("y", [3], 0, [6], 2)]
    kv = m.resolve(first, 7, cpu, 10)
    m.commit(7, ["x", "y"], kv)
    again = m.resolve([delta(req("x", [9], 2, [4, 5, 8], 1), 2)], 8, cpu, 10)
    assert [t.tolist() for t in again] == [[4, 5, 8]] and len(m) == 2  # resolve changes nothing
    with pytest.raises(ValueError, match="KV slot outside"):
        m.resolve([delta(req("x", [9], 2, [4, 5, 11], 1), 2)], 8, cpu, 10)
    with pytest.raises(ValueError, match="twice"):
        m.resolve([first[1], first[1]], 8, cpu, 10)
    m.clear()
    assert len(m) == 0 and m.get("x") is None
    m.check_integrity()
