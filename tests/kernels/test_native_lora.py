"""The native LoRA op (`lora_add`, worker_proc/kernels/native/lora_ops.cpp): every row's term of its own adapter
against float64 products, rows of a slot without an adapter untouched, each row's result the same bits whatever
else is in the batch (batch invariance), out written in place through a row stride, and bad arguments refused."""

from __future__ import annotations

import pytest
import torch

from worker_proc.kernels import native

pytestmark = pytest.mark.skipif(not native.load(), reason="the fused CPU kernels cannot be built here")

RANKS = {1: 5, 2: 16, 4: 1}
"""Slot -> rank of the stacked adapters (slot 3 has none here)."""


def _stacks(k: int, n: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    total = sum(RANKS.values())
    a = (torch.randn(total, k, generator=gen) / k**0.5).to(dtype)
    bt = (torch.randn(total, n, generator=gen) / 4).to(dtype)
    cols = torch.zeros(5, 2, dtype=torch.int64)
    at = 0
    for slot, r in RANKS.items():
        cols[slot] = torch.tensor([at, at + r])
        at += r
    return a, bt, cols


def _expected(base: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, cols: torch.Tensor,
              row_slot: torch.Tensor) -> torch.Tensor:  # fmt: skip
    out = base.double().clone()
    for m, slot in enumerate(row_slot.tolist()):
        lo, hi = cols[slot].tolist()
        out[m] += (x[m].double() @ a[lo:hi].double().t()) @ bt[lo:hi].double()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("k", "n"), [(64, 96), (37, 100), (768, 3000), (16, 7)])
def test_each_row_takes_its_own_adapters_term(dtype: torch.dtype, k: int, n: int) -> None:
    a, bt, cols = _stacks(k, n, dtype)
    gen = torch.Generator().manual_seed(1)
    row_slot = torch.tensor([1, 1, 0, 2, 1, 3, 4, 2, 2, 2, 2, 1])
    x = torch.randn(len(row_slot), k, generator=gen).to(dtype)
    base = torch.randn(len(row_slot), n, generator=gen).to(dtype)
    out = base.clone()
    returned = torch.ops.hyssm_cpu.lora_add(out, x, a, bt, cols, row_slot)
    assert returned.data_ptr() == out.data_ptr()
    want = _expected(base, x, a, bt, cols, row_slot)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.double() - want).abs().max() <= tol * max(1.0, want.abs().max().item())
    untouched = (row_slot == 0) | (row_slot == 3)
    assert torch.equal(out[untouched], base[untouched])
    assert (out[~untouched].double() - base[~untouched].double()).abs().max() > 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_batch(dtype: torch.dtype) -> None:
    k, n = 200, 300
    a, bt, cols = _stacks(k, n, dtype, seed=3)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(40, k, generator=gen).to(dtype)
    base = torch.randn(40, n, generator=gen).to(dtype)
    row_slot = torch.randint(0, 5, (40,), generator=gen)
    full = torch.ops.hyssm_cpu.lora_add(base.clone(), x, a, bt, cols, row_slot)
    for m in (0, 7, 39):
        alone = torch.ops.hyssm_cpu.lora_add(base[m : m + 1].clone(), x[m : m + 1], a, bt, cols, row_slot[m : m + 1])
        assert torch.equal(alone, full[m : m + 1])
    with_others = cols.clone()  # the same adapter at another place of the stacks, others around it
    a2, bt2 = torch.cat([a[5:], a[:5]]), torch.cat([bt[5:], bt[:5]])
    for slot, span in ((1, [17, 22]), (2, [0, 16]), (4, [16, 17])):
        with_others[slot] = torch.tensor(span)
    moved = torch.ops.hyssm_cpu.lora_add(base.clone(), x, a2, bt2, with_others, row_slot)
    assert torch.equal(moved, full)


def test_out_is_written_through_its_row_stride() -> None:
    k, n = 48, 80
    a, bt, cols = _stacks(k, n, torch.float32)
    x = torch.randn(6, k)
    wide = torch.randn(6, n + 32)
    view = wide[:, 16 : 16 + n]
    before = wide.clone()
    row_slot = torch.tensor([1, 2, 0, 4, 1, 2])
    torch.ops.hyssm_cpu.lora_add(view, x, a, bt, cols, row_slot)
    assert torch.equal(wide[:, :16], before[:, :16]) and torch.equal(wide[:, 16 + n :], before[:, 16 + n :])
    want = _expected(before[:, 16 : 16 + n], x, a, bt, cols, row_slot)
    assert (view.double() - want).abs().max() <= 1e-5


def test_bad_arguments_are_refused() -> None:
    a, bt, cols = _stacks(32, 40, torch.float32)
    x, out = torch.randn(3, 32), torch.zeros(3, 40)
    with pytest.raises(RuntimeError, match="outside 0..4"):
        torch.ops.hyssm_cpu.lora_add(out, x, a, bt, cols, torch.tensor([0, 5, 1]))
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.hyssm_cpu.lora_add(out, x.bfloat16(), a, bt, cols, torch.tensor([0, 1, 1]))
    with pytest.raises(RuntimeError, match="out of range"):
        bad = cols.clone()
        bad[1] = torch.tensor([20, 40])
        torch.ops.hyssm_cpu.lora_add(out, x, a, bt, bad, torch.tensor([0, 1, 1]))
    with pytest.raises(RuntimeError, match=r"a \[C, 32\] and bt"):
        torch.ops.hyssm_cpu.lora_add(out, x, a[:, :16].contiguous(), bt, cols, torch.tensor([0, 1, 1]))
