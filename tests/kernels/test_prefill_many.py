"""Every kernel set's `*_prefill_many` (the one call a mixer makes for all prefill segments of a step)
against one single-segment call per segment: the same outputs and the same pool rows, only the
segments' slots touched. Bitwise for the batch-invariant sets (`ReferenceOps`, `TritonOps`,
interpreted here), to fp32 rounding for `FastOps` (whose batched paths pad the segments)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.kernels.util import TOL, max_diff, pool, rand, strided, untouched
from worker_proc.kernels import FastOps, KernelOps, ReferenceOps
from worker_proc.kernels.gated_delta import l2_normalize
from worker_proc.kernels.gdn_ops import FastGdn, ReferenceGdn
from worker_proc.kernels.interface import SsdParams
from worker_proc.kernels.triton.ops import TritonOps

SLOTS = [5, 2, 7, 1]
LENGTHS = [[9, 8, 7], [12, 3, 10, 11], [1, 2], [20, 1, 15], [6]]


def _kernel_sets() -> dict[str, Callable[[], KernelOps]]:
    return {"reference": lambda: ReferenceOps(gdn=ReferenceGdn()), "fast": lambda: FastOps(gdn=FastGdn()),
            "triton": TritonOps}  # fmt: skip


def _tol(name: str) -> float:
    return TOL if name == "fast" else 0.0


def _single_calls(spans, call: Callable[[slice, int], torch.Tensor]) -> torch.Tensor:
    outs, start = [], 0
    for length, slot in spans:
        outs.append(call(slice(start, start + length), slot))
        start += length
    return torch.cat(outs)


@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("name", list(_kernel_sets()))
def test_conv_and_scan(name: str, lengths: list[int]) -> None:
    g = torch.Generator().manual_seed(len(lengths))
    heads, p, groups, n, width = 4, 8, 2, 16, 4
    channels = heads * p + 2 * groups * n
    spans = tuple(zip(lengths, SLOTS, strict=False))
    total = sum(lengths)
    conv_pool, ssm_pool = pool(g, 8, channels, width - 1), pool(g, 8, heads, p, n, zero=(7,))
    before = (conv_pool.clone(), ssm_pool.clone())
    xbc, weight, bias = strided(rand(g, total, channels)), rand(g, channels, width, scale=0.5), rand(g, channels)
    x, dt = strided(rand(g, total, heads, p)), rand(g, total, heads)
    b, c = rand(g, total, groups, n, scale=0.3), rand(g, total, groups, n, scale=0.3)
    params = SsdParams(-torch.rand(heads, generator=g) - 0.5, rand(g, heads), rand(g, heads), (0.001, 2.0), 4)
    ops, one = _kernel_sets()[name](), _kernel_sets()[name]()
    conv = ops.conv_prefill_many(xbc, conv_pool, spans, weight, bias)
    y = ops.ssd_prefill_many(x, dt, b, c, params, ssm_pool, spans)
    conv_one, ssm_one = before[0].clone(), before[1].clone()
    conv_ref = _single_calls(spans, lambda r, s: one.conv_prefill(xbc[r], conv_one, s, weight, bias))
    y_ref = _single_calls(spans, lambda r, s: one.ssd_prefill(x[r], dt[r], b[r], c[r], params, ssm_one, s))
    tol = _tol(name)
    assert max_diff(conv, conv_ref) <= tol and max_diff(conv_pool, conv_one) <= tol
    assert max_diff(y, y_ref) <= tol and max_diff(ssm_pool, ssm_one) <= tol
    written = [slot for _, slot in spans]
    assert untouched(before[0], conv_pool, written) and untouched(before[1], ssm_pool, written)


@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("name", list(_kernel_sets()))
def test_attention(name: str, lengths: list[int]) -> None:
    """Segments resuming after different cached prefixes, their KV slots scattered over the pool."""
    g = torch.Generator().manual_seed(10 + len(lengths))
    heads, kv_heads, dim = 4, 2, 16
    starts = [(3 * i) % 7 for i in range(len(lengths))]
    total_kv = sum(s + n for s, n in zip(starts, lengths, strict=True))
    order = torch.randperm(total_kv, generator=g) + 1
    k_pool, v_pool = pool(g, total_kv, kv_heads, dim), pool(g, total_kv, kv_heads, dim)
    spans, at = [], 0
    for n, s in zip(lengths, starts, strict=True):
        spans.append((n, s, order[at : at + s + n]))
        at += s + n
    q = strided(rand(g, sum(lengths), heads, dim))
    ops = _kernel_sets()[name]()
    out = ops.attn_prefill_many(q, k_pool, v_pool, tuple(spans), 0.25)
    ref, start = [], 0
    for n, s, kv_idx in spans:
        ref.append(ops.attn_prefill(q[start : start + n], k_pool, v_pool, kv_idx, s, 0.25))
        start += n
    assert out.shape == q.shape and max_diff(out, torch.cat(ref)) <= _tol(name)


@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("name", list(_kernel_sets()))
def test_gated_delta(name: str, lengths: list[int]) -> None:
    g = torch.Generator().manual_seed(20 + len(lengths))
    heads, dk, dv = 3, 8, 16
    spans = tuple(zip(lengths, SLOTS, strict=False))
    total = sum(lengths)
    state_pool = pool(g, 8, heads, dk, dv, zero=(7,))
    before = state_pool.clone()
    q, k = l2_normalize(rand(g, total, heads, dk)), l2_normalize(rand(g, total, heads, dk))
    v = strided(rand(g, total, heads, dv))
    decay, beta = -torch.rand(total, heads, generator=g), torch.rand(total, heads, generator=g)
    ops = _kernel_sets()[name]()
    o = ops.gdn_prefill_many(q, k, v, decay, beta, 0.5, state_pool, spans)
    one = before.clone()
    o_ref = _single_calls(spans, lambda r, s: ops.gdn_prefill(q[r], k[r], v[r], decay[r], beta[r], 0.5, one, s))
    assert o.shape == (total, heads, dv) and max_diff(o, o_ref) <= _tol(name)
    assert max_diff(state_pool, one) <= _tol(name)
    assert untouched(before, state_pool, [slot for _, slot in spans])
