"""`FastOps` (the default CPU kernels) against `ReferenceOps`: same results to fp32 rounding, pools
written only at the given slots, scan results independent of where chunks start."""

from __future__ import annotations

import pytest
import torch

from worker_proc.kernels import FastOps, ReferenceOps
from worker_proc.kernels.fast import SCAN_CHUNK, ssd_scan_fast
from worker_proc.kernels.interface import SsdParams
from worker_proc.kernels.reference import ssd_chunk_scan
from worker_proc.kernels.segments import batchable

G = torch.Generator().manual_seed(1)
NO_LIMIT = (0.0, float("inf"))


def _rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=G)


def _close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> bool:
    return bool((a - b).abs().max() <= rel * max(1.0, float(b.abs().max())))


def _scan_inputs(length: int, heads: int, p: int, groups: int, n: int) -> tuple[torch.Tensor, ...]:
    x = _rand(length, heads, p)
    dt = torch.rand(length, heads, generator=G) * 0.5
    a = -torch.rand(heads, generator=G) * 8  # strong decay: exercises the cumulative-sum differences
    return x, dt, a, _rand(length, groups, n), _rand(length, groups, n), _rand(heads), _rand(heads, p, n)


@pytest.mark.parametrize(
    "length,heads,groups,chunk",
    [(1, 4, 1, 256), (5, 4, 2, 256), (SCAN_CHUNK, 8, 1, 256), (SCAN_CHUNK + 3, 6, 3, 256), (200, 8, 2, 256),
     (37, 4, 4, 16)],
)
def test_scan_matches_reference(length: int, heads: int, groups: int, chunk: int) -> None:
    x, dt, a, b, c, d, s0 = _scan_inputs(length, heads, 4, groups, 8)
    y_ref, final_ref = ssd_chunk_scan(x, dt, a, b, c, d, chunk, s0)
    y, final = ssd_scan_fast(x, dt, a, b, c, d, chunk, s0)
    assert _close(y, y_ref) and _close(final, final_ref)


def test_scan_resumed_midway_equals_whole() -> None:
    x, dt, a, b, c, d, s0 = _scan_inputs(150, 4, 4, 2, 8)
    y_all, final_all = ssd_scan_fast(x, dt, a, b, c, d, 256, s0)
    y1, mid = ssd_scan_fast(x[:71], dt[:71], a, b[:71], c[:71], d, 256, s0)
    y2, final = ssd_scan_fast(x[71:], dt[71:], a, b[71:], c[71:], d, 256, mid)
    assert _close(torch.cat([y1, y2]), y_all) and _close(final, final_all)


def _pools(slots: int, heads: int, p: int, n: int) -> torch.Tensor:
    pool = _rand(slots, heads, p, n)
    pool[0] = 0
    return pool


def test_ssd_ops_match_reference_and_touch_only_their_slots() -> None:
    heads, p, groups, n = 6, 4, 3, 8
    fast_pool = _pools(7, heads, p, n)
    ref_pool = fast_pool.clone()
    before = fast_pool.clone()
    x, dt, a, b, c, d, _ = _scan_inputs(3, heads, p, groups, n)
    dt_bias = _rand(heads)
    slots = torch.tensor([5, 2, 3])
    params = SsdParams(a, d, dt_bias, NO_LIMIT, 256)
    y = FastOps().ssd_decode(x, dt, b, c, params, fast_pool, slots)
    y_ref = ReferenceOps().ssd_decode(x, dt, b, c, params, ref_pool, slots)
    assert _close(y, y_ref) and _close(fast_pool, ref_pool)
    x, dt, a, b, c, d, _ = _scan_inputs(90, heads, p, groups, n)
    params = SsdParams(a, d, dt_bias, (0.001, 0.2), 32)
    y = FastOps().ssd_prefill(x, dt, b, c, params, fast_pool, 6)
    y_ref = ReferenceOps().ssd_prefill(x, dt, b, c, params, ref_pool, 6)
    assert _close(y, y_ref) and _close(fast_pool, ref_pool)
    for untouched in (0, 1, 4):
        assert torch.equal(fast_pool[untouched], before[untouched])


def test_attention_ops_match_reference() -> None:
    slots, kvh, dim, heads = 50, 2, 8, 6
    k_pool, v_pool = _rand(slots, kvh, dim), _rand(slots, kvh, dim)
    k_pool[0] = v_pool[0] = 0
    fast, ref = FastOps(), ReferenceOps(batch_invariant=False)
    for length, start in ((9, 0), (4, 11), (1, 20), (1, 0)):
        q = _rand(length, heads, dim)
        idx = torch.randperm(slots - 1, generator=G)[: start + length] + 1
        assert _close(fast.attn_prefill(q, k_pool, v_pool, idx, start, 0.3),
                      ref.attn_prefill(q, k_pool, v_pool, idx, start, 0.3))
    q = _rand(3, heads, dim)
    idx = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 0, 0, 0], [8, 9, 10, 11, 0]])
    lengths = torch.tensor([5, 2, 4])
    assert _close(fast.attn_decode(q, k_pool, v_pool, idx, lengths, 0.3),
                  ref.attn_decode(q, k_pool, v_pool, idx, lengths, 0.3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_conv_decode_matches_reference_and_touches_only_its_slots(dtype: torch.dtype, with_bias: bool) -> None:
    channels, width = 12, 4
    pool = _rand(6, channels, width - 1).to(dtype)
    pool[0] = 0
    ref_pool, before = pool.clone(), pool.clone()
    x, weight = _rand(3, channels).to(dtype), _rand(channels, width).to(dtype)
    bias = _rand(channels).to(dtype) if with_bias else None
    slots = torch.tensor([4, 1, 3])
    out = FastOps().conv_decode(x, pool, slots, weight, bias)
    out_ref = ReferenceOps().conv_decode(x, ref_pool, slots, weight, bias)
    assert out.dtype == out_ref.dtype == dtype
    assert _close(out.float(), out_ref.float()) and torch.equal(pool, ref_pool)
    assert not torch.equal(pool[4], before[4])
    for untouched in (0, 2, 5):
        assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("lengths", [[128, 128, 128], [70, 64, 5, 60], [1, 2], [200, 3, 150], [37]])
def test_prefill_of_many_segments_matches_one_call_each(lengths: list[int]) -> None:
    """The batched conv and scan over several segments (padded to the longest when `batchable`, one call
    each when not) give each segment's single-call outputs and states, and touch only their slots."""
    heads, p, groups, n, width = 6, 4, 3, 8, 4
    channels = heads * p + 2 * groups * n
    slots = [5, 2, 7, 1][: len(lengths)]
    spans = tuple(zip(lengths, slots, strict=True))
    total = sum(lengths)
    conv_pool, ssm_pool = _rand(9, channels, width - 1), _pools(9, heads, p, n)
    before = (conv_pool.clone(), ssm_pool.clone())
    ref_conv, ref_ssm = conv_pool.clone(), ssm_pool.clone()
    xbc, weight, bias = _rand(total, channels), _rand(channels, width), _rand(channels)
    x, dt, a, _, _, d, _ = _scan_inputs(total, heads, p, groups, n)
    b, c = _rand(total, groups, n), _rand(total, groups, n)
    params = SsdParams(a, d, _rand(heads), (0.001, 0.5), 32)
    fast, ref = FastOps(), ReferenceOps(batch_invariant=False)
    conv = fast.conv_prefill_many(xbc, conv_pool, spans, weight, bias)
    y = fast.ssd_prefill_many(x, dt, b, c, params, ssm_pool, spans)
    conv_ref, y_ref, start = [], [], 0
    for length, slot in spans:
        rows = slice(start, start + length)
        conv_ref.append(ref.conv_prefill(xbc[rows], ref_conv, slot, weight, bias))
        y_ref.append(ref.ssd_prefill(x[rows], dt[rows], b[rows], c[rows], params, ref_ssm, slot))
        start += length
    assert conv.shape == (total, channels) and y.shape == (total, heads, p)
    assert _close(conv, torch.cat(conv_ref)) and _close(conv_pool, ref_conv)
    assert _close(y, torch.cat(y_ref)) and _close(ssm_pool, ref_ssm)
    for untouched in set(range(9)) - set(slots):
        assert torch.equal(conv_pool[untouched], before[0][untouched])
        assert torch.equal(ssm_pool[untouched], before[1][untouched])


def test_segments_are_batched_only_when_padding_is_cheap() -> None:
    assert batchable([128, 128]) and batchable([70, 64, 60])
    assert not batchable([37]) and not batchable([200, 3, 150]) and not batchable([512, 1])
