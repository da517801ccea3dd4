"""Attention over slot-indexed KV: Triton (decode split-K, varlen prefill, interpreted) and the CPU kernels
against the reference."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.util import TOL, cu_seqlens, max_diff, rand
from worker_proc.kernels import reference as ref
from worker_proc.kernels.triton.attention import attn_decode, attn_prefill_varlen

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


def _context(gen: torch.Generator, layout: str) -> tuple[torch.Tensor, int]:
    """KV slots of a 700-token context in `layout`, and how many of its views of the pool to expect."""
    if layout == "one_run_of_slots":
        return torch.arange(40, 740), 1
    scattered = torch.randperm(300, generator=gen)[:140] + 1  # from slots 1..300
    if layout == "scattered_slots":
        return torch.cat([scattered, torch.randperm(400, generator=gen)[:560] + 301]), 0
    # runs of 300 and 260 slots (views), the rest scattered between them, as decode slots of other
    # requests and a cached prefix leave a long context; one run ends where the next one begins
    return torch.cat([torch.arange(301, 601), scattered[:70], torch.arange(601, 861), scattered[70:]]), 2


@pytest.mark.parametrize("layout", ["one_run_of_slots", "runs_and_scattered_slots", "scattered_slots"])
def test_fast_attention_reads_runs_of_slots_in_place(gen: torch.Generator, layout: str) -> None:
    """The CPU kernels read each long run of slots of a context as a view of the pool (no copy of the
    context per layer and step) and gather the rest; whatever the layout they give the reference's
    prefill after a cached prefix (also one token long) and decode of one request."""
    from worker_proc.kernels.fast import CONTEXT_RUN, FastOps, context_parts

    k_pool = rand(gen, 1201, 2, 16)
    v_pool = rand(gen, 1201, 2, 16)
    kv, views = _context(gen, layout)
    n = kv.numel()
    assert CONTEXT_RUN <= 260 and len(set(kv.tolist())) == n
    parts = context_parts(k_pool, v_pool, kv)
    shares = [k.untyped_storage().data_ptr() == k_pool.untyped_storage().data_ptr() for k, _ in parts]
    assert sum(shares) == views and len(parts) == views + (layout != "one_run_of_slots")
    assert torch.equal(torch.cat([k for k, _ in parts]).sort(0).values, k_pool[kv].sort(0).values)
    ops = FastOps()
    for cached in (n - 90, n - 1):
        q = rand(gen, n - cached, 6, 16)
        out = ops.attn_prefill(q, k_pool, v_pool, kv, cached, SCALE)
        assert max_diff(out, ref.attention_prefill(q, k_pool[kv], v_pool[kv], cached, SCALE)) <= TOL
    q1 = rand(gen, 1, 6, 16)
    lens = torch.tensor([n])
    out = ops.attn_decode(q1, k_pool, v_pool, kv[None], lens, SCALE)
    assert max_diff(out, ref.attention_decode(q1, k_pool[kv[None]], v_pool[kv[None]], lens, SCALE)) <= TOL
