"""Triton SSD scan (varlen, with states at positions) and decode step against the reference, interpreted."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.util import TOL, cu_seqlens, max_diff, pool, rand, strided, untouched
from worker_proc.kernels import reference as ref
from worker_proc.kernels.triton.chunk_plan import plan_chunks
from worker_proc.kernels.triton.ssd import ssd_scan_varlen
from worker_proc.kernels.triton.ssd_step import ssd_step

NO_LIMIT = (0.0, float("inf"))


def _inputs(gen: torch.Generator, total: int, heads: int, p: int, groups: int, n: int, dtype=torch.float32):
    return dict(
        x=strided(rand(gen, total, heads, p, dtype=dtype)),
        dt=strided(rand(gen, total, heads, dtype=dtype)),
        a=-torch.rand(heads, generator=gen) - 0.1,
        b=strided(rand(gen, total, groups, n, dtype=dtype)),
        c=strided(rand(gen, total, groups, n, dtype=dtype)),
        d=rand(gen, heads, dtype=dtype),
        dt_bias=rand(gen, heads, dtype=dtype),
    )


def _ref_scan(t: dict, lengths, slots, positions, chunk, limit, ssm_pool):
    cu = cu_seqlens(lengths)
    ys, states = [], []
    for r, slot in enumerate(slots):
        rows = slice(cu[r], cu[r + 1])
        dt = ref.discretize_dt(t["dt"][rows], t["dt_bias"], limit)
        y, final, st = ref.ssd_chunk_scan_with_states(
            t["x"][rows], dt, t["a"], t["b"][rows], t["c"][rows], t["d"], chunk, ssm_pool[slot], positions[r]
        )
        ssm_pool[slot] = final
        ys.append(y)
        states.extend(st)
    return torch.cat(ys), states


@pytest.mark.parametrize(
    ("chunk", "groups", "limit"),
    [(5, 1, NO_LIMIT), (7, 2, (0.05, 1.5)), (80, 2, NO_LIMIT)],  # 80: two 64-row blocks per chunk
)
def test_scan_ragged_batch(gen: torch.Generator, chunk: int, groups: int, limit: tuple[float, float]) -> None:
    heads, p, n = 4, 8, 16
    lengths, slots = ([1, 13, 4, 11], [3, 1, 5, 2]) if chunk < 64 else ([70, 3], [2, 4])
    positions = [(), (5, 7, 13), (), (2,)] if chunk < 64 else [(66,), ()]
    t = _inputs(gen, sum(lengths), heads, p, groups, n)
    ssm = pool(gen, 5, heads, p, n, zero=(1,))  # slot 1 starts from zeros, the others not
    mine = ssm.clone()
    plan = plan_chunks(lengths, chunk, positions)
    y, states = ssd_scan_varlen(**t, dt_limit=limit, plan=plan, ssm_pool=mine, slots=torch.tensor(slots))
    expect_y, expect_states = _ref_scan(t, lengths, slots, positions, chunk, limit, ssm)
    assert y.dtype == torch.float32 and y.shape == expect_y.shape
    assert max_diff(y, expect_y) <= TOL
    assert max_diff(mine, ssm) <= TOL
    assert len(states) == len(expect_states)
    for got, want in zip(states, expect_states, strict=True):
        assert max_diff(got, want) <= TOL
    assert untouched(ssm, mine, slots) and not mine[0].any()


def test_scan_half_precision(gen: torch.Generator) -> None:
    """bf16 inputs (dots in bf16 on GPUs; upcast under the interpreter) vs the fp32 reference."""
    heads, p, n = 2, 16, 16
    lengths, slots = [9, 20], [1, 2]
    t = _inputs(gen, sum(lengths), heads, p, 1, n, dtype=torch.bfloat16)
    ssm = pool(gen, 2, heads, p, n)
    mine = ssm.clone()
    y, _ = ssd_scan_varlen(
        **t, dt_limit=NO_LIMIT, plan=plan_chunks(lengths, 8), ssm_pool=mine, slots=torch.tensor(slots)
    )
    expect_y, _ = _ref_scan(t, lengths, slots, [(), ()], 8, NO_LIMIT, ssm)
    assert max_diff(y, expect_y) <= 0.02 * float(expect_y.abs().max())
    assert max_diff(mine, ssm) <= 0.02 * float(ssm.abs().max())


def test_decode_step_with_padding_row(gen: torch.Generator) -> None:
    heads, p, groups, n = 4, 8, 2, 16
    slots = torch.tensor([2, 0, 5])  # row 1 is padding (slot 0): output computed, state never written
    t = _inputs(gen, 3, heads, p, groups, n)
    ssm = pool(gen, 5, heads, p, n, zero=(5,))
    mine = ssm.clone()
    limit = (0.01, 2.0)
    y = ssd_step(**t, dt_limit=limit, ssm_pool=mine, slots=slots)
    dt = ref.discretize_dt(t["dt"], t["dt_bias"], limit)
    expect_y, new = ref.ssd_state_step(ssm[slots], t["x"], dt, t["a"], t["b"], t["c"], t["d"])
    assert max_diff(y, expect_y) <= TOL
    assert max_diff(mine[2], new[0]) <= TOL and max_diff(mine[5], new[2]) <= TOL
    assert untouched(ssm, mine, [2, 5]) and not mine[0].any()


def test_prefill_then_decode_equals_one_scan(gen: torch.Generator) -> None:
    """Scan 10 tokens, then 3 decode steps on the same slot == one reference scan over 13 tokens."""
    heads, p, n = 2, 8, 16
    t = _inputs(gen, 13, heads, p, 1, n)
    ssm = pool(gen, 2, heads, p, n)
    mine = ssm.clone()
    slot = torch.tensor([2])
    first = {k: (v[:10] if v.shape[0] == 13 else v) for k, v in t.items()}
    ys = [ssd_scan_varlen(**first, dt_limit=NO_LIMIT, plan=plan_chunks([10], 4), ssm_pool=mine, slots=slot)[0]]
    for i in range(10, 13):
        step = {k: (v[i : i + 1] if v.shape[0] == 13 else v) for k, v in t.items()}
        ys.append(ssd_step(**step, dt_limit=NO_LIMIT, ssm_pool=mine, slots=slot))
    dt = ref.discretize_dt(t["dt"], t["dt_bias"], NO_LIMIT)
    expect_y, final = ref.ssd_chunk_scan(t["x"], dt, t["a"], t["b"], t["c"], t["d"], 4, ssm[2])
    assert max_diff(torch.cat(ys), expect_y) <= TOL
    assert max_diff(mine[2], final) <= TOL


def test_scan_is_batch_invariant(gen: torch.Generator) -> None:
    """A request's y and final state are bitwise the same scanned alone or in a ragged batch."""
    lengths, slots = [9, 20, 3], [1, 2, 3]
    t = _inputs(gen, sum(lengths), 2, 8, 1, 16)
    ssm = pool(gen, 3, 2, 8, 16)
    batched = ssm.clone()
    y, _ = ssd_scan_varlen(
        **t, dt_limit=NO_LIMIT, plan=plan_chunks(lengths, 4), ssm_pool=batched, slots=torch.tensor(slots)
    )
    cu = cu_seqlens(lengths)
    for r, slot in enumerate(slots):
        alone = ssm.clone()
        part = {k: (v[cu[r] : cu[r + 1]] if v.shape[0] == cu[-1] else v) for k, v in t.items()}
        y_r, _ = ssd_scan_varlen(
            **part, dt_limit=NO_LIMIT, plan=plan_chunks([lengths[r]], 4), ssm_pool=alone, slots=torch.tensor([slot])
        )
        assert torch.equal(y_r, y[cu[r] : cu[r + 1]]) and torch.equal(alone[slot], batched[slot])
