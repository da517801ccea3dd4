"""Batch invariance: requests of different lengths and phases (fresh prefill, resumed prefill,
decode, one-token fresh prefill) in one step give the same logits and leave the same KV/Mamba state
as when each runs alone: bitwise in the deterministic mode, to fp32 rounding (<= 1e-4 of the values'
size, at least 1) by default, where each row count may take another product method;
for every model family (so every family's GEMMs are covered by the deterministic mode)."""

from __future__ import annotations

import pytest
import torch

from shared.messages import ReqSlice
from tests.model_driver import forward_all_logits, forward_logits
from tests.worker.util import FAMILY_FIXTURES, GDN_FIXTURES, batch, max_diff, req, runner
from worker_proc.runtime.runner import ModelRunner

TOL = {True: 0.0, False: 1e-4}  # by deterministic mode


def close(got: torch.Tensor, want: torch.Tensor, deterministic: bool) -> bool:
    return max_diff(got, want) <= TOL[deterministic] * max(1.0, float(want.abs().max()) if want.numel() else 1.0)


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (n,), generator=g).tolist()


def _setup(r: ModelRunner) -> list[ReqSlice]:
    """Prefill the prefixes of the resumed/decode requests alone, return this step's slices."""
    b_prompt, c_prompt, d_prompt = _prompt(1, 16), _prompt(2, 13), _prompt(3, 6)
    kv_b = list(range(1, 17))
    kv_c = list(range(20, 33))
    kv_d = list(range(40, 46))
    forward_logits(r, batch(0, [req("b", b_prompt[:9], 0, kv_b[:9], 2)], clears=[2]))
    forward_logits(r, batch(1, [req("c", c_prompt[:12], 0, kv_c[:12], 3)], clears=[3]))
    forward_logits(r, batch(2, [req("d", d_prompt[:5], 0, kv_d[:5], 4)], clears=[4]))
    return [
        req("a", _prompt(0, 11), 0, list(range(50, 61)), 1),  # fresh prefill
        req("b", b_prompt[9:], 9, kv_b, 2),  # resumed prefill (7 more tokens)
        req("c", c_prompt[12:], 12, kv_c, 3),  # decode
        req("d", d_prompt[5:], 5, kv_d, 4),  # decode, shorter context
        req("e", _prompt(4, 1), 0, [70], 5),  # one-token fresh prefill
        req("f", _prompt(5, 8), 0, list(range(80, 88)), 6, sample=False),  # non-final chunk
    ]


Logits = dict[str, torch.Tensor]


def mixed_and_alone(alone: ModelRunner, together: ModelRunner) -> tuple[Logits, Logits]:
    """The step of `_setup`'s slices run together on `together` and one by one on `alone`: (together's
    logits, alone's) by request."""
    slices = _setup(alone)
    assert _setup(together) == slices
    fresh = [1, 5, 6]
    expected: dict[str, torch.Tensor] = {}
    for i, sl in enumerate(slices):
        clears = [sl.state_slot] if sl.state_slot in fresh else []
        expected.update(forward_all_logits(alone, batch(10 + i, [sl], clears=clears)))
    return forward_all_logits(together, batch(10, slices, clears=fresh)), expected


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("name", ["rope_moe", "nope_groups2", *FAMILY_FIXTURES, *GDN_FIXTURES])
def test_mixed_batch_equals_each_alone(name: str, deterministic: bool) -> None:
    alone, together = runner(name, deterministic=deterministic), runner(name, deterministic=deterministic)
    got, expected = mixed_and_alone(alone, together)
    assert set(got) == set(expected) == {"a", "b", "c", "d", "e", "f"}
    for rid in expected:
        assert close(got[rid], expected[rid], deterministic), rid
    pools = {"k": (alone.pools.k, together.pools.k), "v": (alone.pools.v, together.pools.v)}
    pools.update({name: (t, together.pools.states[name]) for name, t in alone.pools.states.items()})
    for pool, (a, b) in pools.items():
        if a.numel() == 0:  # no such layer (Mamba2: no KV tensor; GDN models: no Mamba state)
            continue
        assert close(b, a, deterministic), pool
    together.check_integrity()


def test_step_samples_only_final_chunks() -> None:
    r = runner("rope_moe")
    slices = _setup(r)
    res = r.step(batch(10, slices, clears=[1, 5, 6]))
    assert res.step == 10 and res.refused == []
    assert set(res.next_tokens) == {"a", "b", "c", "d", "e"}
    assert all(0 <= t < 300 for t in res.next_tokens.values())
