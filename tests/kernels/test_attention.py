"""Attention over slot-indexed KV: Triton (decode split-K, varlen prefill, interpreted) and the CPU kernels
against the reference."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.util import TOL, cu_seqlens, max_diff, rand
from worker_proc.kernels import reference as ref
from worker_proc.kernels.triton_attention import attn_decode, attn_prefill_varlen

SLOTS = 300
SCALE = 0.3


def _kv_pools(gen: torch.Generator, kv_heads: int, dim: int, dtype=torch.float32):
    k, v = rand(gen, SLOTS + 1, kv_heads, dim, dtype=dtype), rand(gen, SLOTS + 1, kv_heads, dim, dtype=dtype)
    k[0], v[0] = 0, 0
    return k, v


def _slots(gen: torch.Generator, n: int) -> torch.Tensor:
    return torch.randperm(SLOTS, generator=gen)[:n] + 1  # scattered, never the padding slot


@pytest.mark.parametrize("split_size", [1024, 64, 32])  # 32: five splits, short rows have empty ones
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(6, 2, 16), (4, 4, 8)])
def test_decode_ragged_lengths(gen: torch.Generator, split_size: int, heads: int, kv_heads: int, dim: int) -> None:
    lengths = [1, 5, 130, 40]  # 130 crosses two 64-key blocks
    width = max(lengths) + 3  # padded past the longest row too
    kv_idx = torch.zeros(len(lengths), width, dtype=torch.int64)
    for row, n in enumerate(lengths):
        kv_idx[row, :n] = _slots(gen, n)
    k_pool, v_pool = _kv_pools(gen, kv_heads, dim)
    q = rand(gen, len(lengths), heads, dim)
    lens = torch.tensor(lengths)
    out = attn_decode(q, k_pool, v_pool, kv_idx, lens, SCALE, split_size=split_size)
    expect = ref.attention_decode(q, k_pool[kv_idx], v_pool[kv_idx], lens, SCALE)
    assert out.dtype == q.dtype and max_diff(out, expect) <= TOL


def test_decode_is_batch_invariant(gen: torch.Generator) -> None:
    """A request's output is bitwise the same alone and batched with longer requests (fixed splits)."""
    k_pool, v_pool = _kv_pools(gen, 2, 16)
    q = rand(gen, 3, 4, 16)
    lengths = [270, 40, 290]  # default split_size 256: the short row is split-free alone, not batched
    kv_idx = torch.zeros(3, 290, dtype=torch.int64)
    for row, n in enumerate(lengths):
        kv_idx[row, :n] = _slots(gen, n)
    batched = attn_decode(q, k_pool, v_pool, kv_idx, torch.tensor(lengths), SCALE)
    for row, n in enumerate(lengths):
        alone = attn_decode(q[row : row + 1], k_pool, v_pool, kv_idx[row : row + 1, :n], torch.tensor([n]), SCALE)
        assert torch.equal(alone, batched[row : row + 1]), f"row {row}"
    expect = ref.attention_decode(q, k_pool[kv_idx], v_pool[kv_idx], torch.tensor(lengths), SCALE)
    assert max_diff(batched, expect) <= TOL


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(6, 2, 16), (2, 1, 80)])  # 80: head dim padded to 128
def test_prefill_ragged_with_cached_prefix(gen: torch.Generator, heads: int, kv_heads: int, dim: int) -> None:
    starts, news = [0, 3, 70], [5, 1, 67]  # 67 new tokens cross the 64-query block; 70 cached
    k_pool, v_pool = _kv_pools(gen, kv_heads, dim)
    q = rand(gen, sum(news), heads, dim)
    cu_q, kv_lens = cu_seqlens(news), [s + n for s, n in zip(starts, news, strict=True)]
    kv = [_slots(gen, n) for n in kv_lens]
    out = attn_prefill_varlen(
        q,
        k_pool,
        v_pool,
        torch.cat(kv),
        torch.tensor(cu_q, dtype=torch.int32),
        torch.tensor(cu_seqlens(kv_lens), dtype=torch.int32),
        max(news),
        SCALE,
    )
    expect = torch.cat(
        [
            ref.attention_prefill(q[cu_q[r] : cu_q[r + 1]], k_pool[kv[r]], v_pool[kv[r]], starts[r], SCALE)
            for r in range(len(news))
        ]
    )
    assert out.dtype == q.dtype and max_diff(out, expect) <= TOL


def test_half_precision(gen: torch.Generator) -> None:
    """bf16 pools and queries: output in bf16, within bf16 rounding of the fp32-softmax reference."""
    k_pool, v_pool = _kv_pools(gen, 2, 16, dtype=torch.bfloat16)
    kv = _slots(gen, 12)
    q = rand(gen, 4, 4, 16, dtype=torch.bfloat16)
    out = attn_prefill_varlen(
        q,
        k_pool,
        v_pool,
        kv,
        torch.tensor([0, 4], dtype=torch.int32),
        torch.tensor([0, 12], dtype=torch.int32),
        4,
        SCALE,
    )
    assert out.dtype == torch.bfloat16
    assert max_diff(out, ref.attention_prefill(q, k_pool[kv], v_pool[kv], 8, SCALE)) <= 0.03
    lens = torch.tensor([12])
    dec = attn_decode(q[:1], k_pool, v_pool, kv[None], lens, SCALE, split_size=8)
    assert max_diff(dec, ref.attention_decode(q[:1], k_pool[kv[None]], v_pool[kv[None]], lens, SCALE)) <= 0.03


@pytest.mark.parametrize("run", [True, False], ids=["one_run_of_slots", "scattered_slots"])
def test_fast_attention_reads_a_run_of_slots_in_place(gen: torch.Generator, run: bool) -> None:
    """The CPU kernels read a context held in one ascending run of slots as a view of the pool (no copy
    of the context per layer and step) and a scattered one by gathering; both give the reference's
    prefill after a cached prefix and decode of one request."""
    from worker_proc.kernels.fast import FastOps, pool_rows

    k_pool, v_pool = _kv_pools(gen, 2, 16)
    n, cached = 90, 70
    kv = torch.arange(40, 40 + n) if run else _slots(gen, n)
    assert (pool_rows(k_pool, kv).untyped_storage().data_ptr() == k_pool.untyped_storage().data_ptr()) == run
    ops = FastOps()
    q = rand(gen, n - cached, 6, 16)
    out = ops.attn_prefill(q, k_pool, v_pool, kv, cached, SCALE)
    assert max_diff(out, ref.attention_prefill(q, k_pool[kv], v_pool[kv], cached, SCALE)) <= TOL
    q1 = rand(gen, 1, 6, 16)
    lens = torch.tensor([n])
    out = ops.attn_decode(q1, k_pool, v_pool, kv[None], lens, SCALE)
    assert max_diff(out, ref.attention_decode(q1, k_pool[kv[None]], v_pool[kv[None]], lens, SCALE)) <= TOL
