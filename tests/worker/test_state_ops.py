"""State ops applied before the forward pass: copy (copy-on-write), clear, refusal."""

from __future__ import annotations

import pytest
import torch

from shared.messages import CopyOp, ReqSlice
from tests.model_driver import forward_all_logits, forward_logits
from tests.worker.util import batch, max_diff, reference, req, runner


def _snapshot(r, slot: int) -> dict[str, torch.Tensor]:
    """Every recurrent state tensor of `slot` (Mamba conv + ssm, or GDN conv + recurrent state)."""
    return {name: pool[:, slot].clone() for name, pool in r.pools.states.items() if pool.numel()}


@pytest.mark.parametrize("name, cut", [("nope_groups2", 9), ("rope_moe", 9), ("qwen3_next_moe", 70)])
def test_resume_from_copied_state_equals_uninterrupted(name: str, cut: int) -> None:
    prompt = reference(name)["prompt"].tolist()
    n = len(prompt)
    r = runner(name, kv_slots=400)
    kv = list(range(1, n + 1))
    whole = forward_all_logits(r, batch(0, [req("x", prompt, 0, list(range(200, 200 + n)), 4)], clears=[4]))["x"]
    # a cached prefix: state after `cut` tokens in slot 1
    forward_logits(r, batch(1, [req("p", prompt[:cut], 0, kv[:cut], 1, sample=False)], clears=[1]))
    src_before = _snapshot(r, 1)
    # a new request hits the prefix: CoW slot 1 -> slot 2, then computes the rest in slot 2
    sl = req("y", prompt[cut:], cut, kv, 2)
    rest = forward_all_logits(r, batch(2, [sl], copies=[CopyOp(src=1, dst=2, rid="y")]))["y"]
    assert max_diff(rest, whole[cut:]) <= 1e-4  # same tolerance as chunked-prefill parity
    src_after, copy, uninterrupted = _snapshot(r, 1), _snapshot(r, 2), _snapshot(r, 4)
    assert src_before.keys() == src_after.keys() and len(src_before) == 2
    for pool in src_before:
        assert torch.equal(src_before[pool], src_after[pool]), pool  # the source is untouched
        assert not torch.equal(copy[pool], src_after[pool]), pool  # the copy advanced, the source did not
        assert max_diff(copy[pool], uninterrupted[pool]) <= 1e-4, pool  # equals the uninterrupted state
    r.check_integrity()


def test_clear_zeroes_slot_and_padding_untouched() -> None:
    r = runner("nope_groups2")
    prompt = reference("nope_groups2")["prompt"].tolist()
    forward_logits(r, batch(0, [req("a", prompt, 0, list(range(1, 20)), 3)], clears=[3]))
    assert r.pools.ssm[:, 3].abs().sum() > 0 and r.pools.conv[:, 3].abs().sum() > 0
    forward_logits(r, batch(1, [], clears=[3]))
    assert not r.pools.ssm[:, 3].any() and not r.pools.conv[:, 3].any()
    r.check_integrity()
    r.pools.k[0, 0, 0, 0] = 1.0  # a write into padding slot 0 is caught
    with pytest.raises(AssertionError, match="padding slot 0"):
        r.check_integrity()


def test_copies_apply_before_clears() -> None:
    r = runner("nope_groups2")
    prompt = reference("nope_groups2")["prompt"].tolist()
    forward_logits(r, batch(0, [req("a", prompt[:5], 0, list(range(1, 6)), 1)], clears=[1]))
    forward_logits(r, batch(1, [], copies=[CopyOp(src=1, dst=2)], clears=[1]))
    assert not r.pools.ssm[:, 1].any()
    assert r.pools.ssm[:, 2].any()


def test_refused_request_does_not_run_or_copy() -> None:
    r = runner("rope_moe")
    prompt = reference("rope_moe")["prompt"].tolist()
    forward_logits(r, batch(0, [req("p", prompt[:8], 0, list(range(1, 9)), 1, sample=False)], clears=[1]))
    k_before, ssm_before = r.pools.k.clone(), r.pools.ssm.clone()
    refused_slice = req("y", prompt[8:12], 8, list(range(1, 13)), 2)
    ok_slice = req("z", prompt[:3], 0, list(range(40, 43)), 3)
    b = batch(1, [refused_slice, ok_slice], copies=[CopyOp(src=1, dst=2, rid="y"), CopyOp(src=1, dst=4)],
              clears=[3])
    res = r.step(b, refused=frozenset({"y"}))
    assert res.refused == ["y"] and set(res.next_tokens) == {"z"}
    assert not r.pools.ssm[:, 2].any()  # the refused CoW was not applied, nor its slice run
    assert torch.equal(r.pools.k[:, 9:13], k_before[:, 9:13])
    assert torch.equal(r.pools.ssm[:, 4], ssm_before[:, 1])  # the checkpoint copy (rid None) was applied
    r.check_integrity()


def test_malformed_batches_rejected() -> None:
    r = runner("nope_groups2", kv_slots=32, state_slots=4)
    with pytest.raises(ValueError, match="kv_slots"):
        r.step(batch(0, [ReqSlice(rid="a", input_ids=[5, 6], start_pos=1, kv_slots=[1, 2], state_slot=1,
                                  sample=True)]))
    with pytest.raises(ValueError, match="KV slot"):
        r.step(batch(0, [req("a", [5, 6], 0, [1, 33], 1)]))
    with pytest.raises(ValueError, match="KV slot"):
        r.step(batch(0, [req("a", [5, 6], 0, [0, 1], 1)]))
    with pytest.raises(ValueError, match="state slot"):
        r.step(batch(0, [req("a", [5], 0, [1], 5)]))
    with pytest.raises(ValueError, match="duplicate state slots"):
        r.step(batch(0, [req("a", [5], 0, [1], 2), req("b", [6], 0, [2], 2)]))
    with pytest.raises(ValueError, match="state slot"):
        r.step(batch(0, [], copies=[CopyOp(src=0, dst=1)]))
    r.check_integrity()
