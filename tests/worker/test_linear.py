"""`layers.linear`: the split CPU GEMM used for few float32 rows gives F.linear's results (to fp32
rounding) for every row count, thread count and output width; the deterministic padding and the
16-bit and non-contiguous cases keep F.linear exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker_proc.model.layers import SPLIT_GEMM_MAX_ROWS, gemm_parts, linear, split_gemm

G = torch.Generator().manual_seed(3)


@pytest.fixture(params=[1, 2, 3])
def threads(request: pytest.FixtureRequest):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 2, 5, SPLIT_GEMM_MAX_ROWS, SPLIT_GEMM_MAX_ROWS + 1])
@pytest.mark.parametrize("out_features", [1, 7, 12, 96])
def test_linear_matches_f_linear(threads: int, rows: int, out_features: int) -> None:
    x = torch.randn(rows, 48, generator=G)
    w = torch.randn(out_features, 48, generator=G)
    b = torch.randn(out_features, generator=G)
    want = F.linear(x, w, b)
    got = linear(x, w, b)
    assert got.shape == want.shape and got.is_contiguous()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert torch.allclose(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_parts_divide_the_rows(threads: int) -> None:
    for n in (1, 7, 12, 96, 100352):
        parts = gemm_parts(n)
        assert 1 <= parts <= threads and n % parts == 0
    assert gemm_parts(12) == threads  # 1, 2 and 3 all divide 12


def test_split_gemm_uses_every_block() -> None:
    x = torch.randn(3, 16, generator=G)
    w = torch.randn(8, 16, generator=G)
    for parts in (1, 2, 4, 8):
        assert torch.allclose(split_gemm(x, w, parts), x @ w.t(), rtol=1e-5, atol=1e-5)


def test_padded_and_other_dtypes_are_plain_f_linear() -> None:
    x = torch.randn(3, 32, generator=G)
    w = torch.randn(64, 32, generator=G)
    padded = torch.cat([x, x.new_zeros(13, 32)])
    assert torch.equal(linear(x, w, min_rows=16), F.linear(padded, w)[:3])
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(linear(xb, wb), F.linear(xb, wb))
    wt = torch.randn(32, 64, generator=G).t()  # a transposed view: not split
    assert torch.equal(linear(x, wt), F.linear(x, wt))
