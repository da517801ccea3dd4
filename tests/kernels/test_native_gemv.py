"""The fused few-row matrix products (`gemv`, `gemv_seq`: two orders of reading the weight; `tiled`: from the
weight's tiled copy; `gemv_int8`: an int8 weight with its row scales) against F.linear, `gemv_w8a8` and
`tiled_w8a8` (an int8 weight's tiled copy) against `w8a8` to the bit, and their place among the plan's methods."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.util import max_diff, rand, strided
from worker_proc.kernels import native
from worker_proc.kernels.native.layout import TILE_ROWS
from worker_proc.linear.formats import THROUGHPUT_KERNELS
from worker_proc.linear.kernels import (
    GEMV,
    GEMV_INT8,
    GEMV_SEQ,
    GEMV_W8A8,
    TILED,
    TILED_OVER_INT4,
    TILED_W8A8,
    W8A8,
    GemmKernel,
    tile_weight,
)
from worker_proc.linear.site import GemmSite
from worker_proc.quant.layouts import tile_int8
from worker_proc.quant.weight import quantize_int4, quantize_int8, w8a8

pytestmark = pytest.mark.skipif(not native.load(), reason="the fused CPU kernels cannot be built here")


def _stored(method: GemmKernel, weight: torch.Tensor) -> object:
    """The copy of the weight the method reads besides the weight itself."""
    return tile_weight(weight) if method is TILED else None


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 17])
@pytest.mark.parametrize(("out_features", "in_features"), [(64, 256), (37, 100), (6, 16), (200, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("method", [GEMV, GEMV_SEQ, TILED], ids=lambda m: m.name)
def test_gemv_equals_f_linear(rows: int, out_features: int, in_features: int, dtype: torch.dtype, bias: bool,
                              method: GemmKernel) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = strided(rand(gen, rows, in_features, dtype=dtype))  # a view with a row stride, as split projections are
    weight = rand(gen, out_features, in_features, dtype=dtype, scale=0.1)
    b = rand(gen, out_features, dtype=dtype) if bias else None
    got, want = method.apply(x, weight, _stored(method, weight), b), F.linear(x, weight, b)
    assert got.dtype == dtype and got.shape == want.shape and got.is_contiguous()
    # float32 sums in another order: float32's rounding over the inner width, then one rounding to bf16
    ulp = 1e-6 * in_features if dtype == torch.float32 else 2**-7
    assert max_diff(got, want) <= 2 * ulp * max(1.0, float(want.abs().max()))


@pytest.mark.parametrize("method", [GEMV, GEMV_SEQ, TILED], ids=lambda m: m.name)
def test_gemv_runs_on_every_thread_count(method: GemmKernel) -> None:
    """However many threads share the weight's chunks, every output is the same to the bit (one thread
    computes each, in one order)."""
    gen = torch.Generator().manual_seed(3)
    x, weight = rand(gen, 10, 512), rand(gen, 1001, 512, scale=0.05)
    want, stored = F.linear(x, weight), _stored(method, weight)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(method.apply(x, weight, stored, None))
            assert max_diff(outs[-1], want) <= 1e-4
        assert all(torch.equal(out, outs[0]) for out in outs)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("method", [GEMV, GEMV_SEQ, TILED], ids=lambda m: m.name)
def test_the_plan_measures_gemv_for_dense_float_weights_only(method: GemmKernel) -> None:
    assert method in THROUGHPUT_KERNELS
    cpu = torch.device("cpu")
    assert method.supports(GemmSite(64, 64, torch.bfloat16, packable=True), cpu)
    # a tiled copy is made once from a fixed weight: not of an expert's slice of a stack
    assert method.supports(GemmSite(64, 64, torch.float32, packable=False), cpu) == (method is not TILED)
    assert not method.supports(GemmSite(64, 64, torch.float16, packable=True), cpu)
    assert not method.supports(GemmSite(64, 64, torch.float32, packable=True), torch.device("meta"))
    # gemv and gemv_seq are timed at decode and batched-decode buckets only; tiled at every row count
    assert method.max_rows == (0 if method is TILED else 64)


@pytest.mark.parametrize("rows", [65, 130, 513])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_tiled_product_serves_prefill_row_counts(rows: int, dtype: torch.dtype) -> None:
    """One tiled copy serves a prefill chunk too (the plan may keep it alone): every row pass over the
    blocks gives F.linear's values, the last pass of fewer than eight rows included."""
    gen = torch.Generator().manual_seed(rows)
    x, b = rand(gen, rows, 96, dtype=dtype), rand(gen, 200, dtype=dtype)
    weight = rand(gen, 200, 96, dtype=dtype, scale=0.1)
    got, want = TILED.apply(x, weight, tile_weight(weight), b), F.linear(x, weight, b)
    ulp = 1e-6 * 96 if dtype == torch.float32 else 2**-7
    assert got.shape == want.shape and max_diff(got, want) <= 2 * ulp * max(1.0, float(want.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tiled_copy_holds_the_weight_in_blocks_of_sixteen_rows(dtype: torch.dtype) -> None:
    """Rows past the weight's own are zero and never reach the output; a copy of another weight's shape or
    dtype is refused, not read."""
    gen = torch.Generator().manual_seed(5)
    weight = rand(gen, 37, 64, dtype=dtype)
    tiled = tile_weight(weight)
    assert tiled.out_features == 37 and tiled.data.shape[0] == 3 and tiled.data.numel() == 3 * 16 * 64
    assert tiled.nbytes == tiled.data.numel() * weight.element_size()
    x = rand(gen, 4, 64, dtype=dtype)
    assert TILED.apply(x, weight, tiled, None).shape == (4, 37)
    with pytest.raises(RuntimeError, match="tiled weight"):
        torch.ops.hyssm_cpu.tiled_product(x, tiled.data, 60, None)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.hyssm_cpu.tiled_product(x.to(other), tiled.data, 37, None)


@pytest.mark.parametrize("rows", [1, 3, 8, 11])
@pytest.mark.parametrize(("out_features", "in_features"), [(64, 256), (37, 100), (200, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_gemv_equals_the_dequantized_product(rows: int, out_features: int, in_features: int,
                                                  dtype: torch.dtype, bias: bool) -> None:  # fmt: skip
    gen = torch.Generator().manual_seed(rows * 100 + in_features)
    q = quantize_int8(rand(gen, out_features, in_features, scale=0.1))
    x = strided(rand(gen, rows, in_features, dtype=dtype))
    b = rand(gen, out_features, dtype=dtype) if bias else None
    got = GEMV_INT8.apply(x, torch.empty(0), q, b)
    want = F.linear(x.float(), q.data.float() * q.scale[:, None], None if b is None else b.float())
    assert got.dtype == dtype and got.shape == want.shape
    ulp = 1e-6 * in_features if dtype == torch.float32 else 2**-7
    assert max_diff(got, want) <= 2 * ulp * max(1.0, float(want.abs().max()))


def test_the_plan_measures_int8_gemv_for_int8_weights_only() -> None:
    cpu = torch.device("cpu")
    assert GEMV_INT8 in THROUGHPUT_KERNELS and GEMV_INT8.max_rows == 64
    site = GemmSite(64, 64, torch.bfloat16, packable=True)
    assert not GEMV_INT8.supports(site, cpu)
    site.quantize(quantize_int8(torch.randn(64, 64)))
    assert GEMV_INT8.supports(site, cpu) and not GEMV_SEQ.supports(site, cpu)
    stack = GemmSite(64, 64, torch.bfloat16, packable=False)  # an expert stack's
    stack.quantize(quantize_int8(torch.randn(3, 64, 64)))
    assert GEMV_INT8.supports(stack, cpu)


@pytest.mark.parametrize("rows", [1, 2, 8, 9, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features", [256, 100])
@pytest.mark.parametrize("method", [GEMV_W8A8, TILED_W8A8], ids=lambda m: m.name)
def test_w8a8_gemv_is_w8a8_to_the_bit(rows: int, dtype: torch.dtype, in_features: int, method: GemmKernel) -> None:
    """Exact integer sums and the same row quantization: the fused kernels' product is `w8a8`'s, whatever the
    row count (so it is batch invariant as w8a8 is), a zero row included; 70 outputs leave the tiled copy's last
    block part empty."""
    gen = torch.Generator().manual_seed(rows * 10 + in_features)
    q = quantize_int8(rand(gen, 70, in_features, scale=0.1))
    if method.quantized_copy:
        q = q.with_copy(method.quantized_copy)
    x = strided(rand(gen, rows, in_features, dtype=dtype))
    x[0] = 0
    b = rand(gen, 70, dtype=dtype)
    got = method.apply(x, torch.empty(0), q, b)
    assert got.dtype == dtype and torch.equal(got, W8A8.apply(x, torch.empty(0), q, b))
    assert torch.equal(method.apply(x[1:2], torch.empty(0), q, b), got[1:2])
    assert method.batch_invariant and method in THROUGHPUT_KERNELS


def test_the_tiled_int8_product_is_the_same_on_every_thread_count() -> None:
    """Blocks split over one to three threads (1001 outputs: a partial last block, ranges of unequal length),
    rows in passes of eight and a remainder: every output is `w8a8`'s, to the bit."""
    gen = torch.Generator().manual_seed(4)
    q = quantize_int8(rand(gen, 1001, 512, scale=0.05)).with_copy("tiled")
    x = rand(gen, 11, 512, dtype=torch.bfloat16)
    want = W8A8.apply(x, torch.empty(0), q, None)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert torch.equal(TILED_W8A8.apply(x, torch.empty(0), q, None), want), n
    finally:
        torch.set_num_threads(threads)


def test_an_int8_tiled_copy_holds_blocks_of_sixteen_rows_four_columns_side_by_side() -> None:
    gen = torch.Generator().manual_seed(3)
    q = quantize_int8(rand(gen, 37, 12))
    tiles = tile_int8(q.data, q.scale)
    assert tuple(tiles.data.shape) == (3, 3, TILE_ROWS, 4) and tiles.data.dtype == torch.int8
    assert torch.equal(tiles.data[1, 2, 5], q.data[16 + 5, 8:12])  # block 1, columns 8-11, its row 5
    assert torch.equal(tiles.data[2, :, 5:], torch.zeros(3, 11, 4, dtype=torch.int8))  # rows past 37
    assert torch.equal(tiles.row_sums[:37], q.data.sum(1, dtype=torch.int32)) and not tiles.row_sums[37:].any()
    assert q.with_copy("tiled").nbytes == q.nbytes + tiles.data.numel() + 4 * 48


def test_the_tiled_w8a8_kernel_names_what_is_wrong() -> None:
    q = quantize_int8(torch.randn(32, 64)).with_copy("tiled")
    t = q.tiled
    with pytest.raises(RuntimeError, match="tiled as"):
        torch.ops.hyssm_cpu.tiled_w8a8(torch.randn(2, 60), t.data, t.row_sums, t.scale)
    with pytest.raises(RuntimeError, match="row sum"):
        torch.ops.hyssm_cpu.tiled_w8a8(torch.randn(2, 64), t.data, t.row_sums[:16], t.scale)
    with pytest.raises(RuntimeError, match="scale"):
        torch.ops.hyssm_cpu.tiled_w8a8(torch.randn(2, 64), t.data, t.row_sums, t.scale.double())
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.hyssm_cpu.tiled_w8a8(torch.randn(2, 64).half(), t.data, t.row_sums, t.scale)


def test_the_plan_offers_the_tiled_int8_products_to_single_int8_and_int4_matrices() -> None:
    cpu = torch.device("cpu")
    single = GemmSite(64, 64, torch.bfloat16, packable=True)
    single.quantize(quantize_int8(torch.randn(64, 64)))
    assert TILED_W8A8.supports(single, cpu) and not TILED_OVER_INT4.supports(single, cpu)
    stack = GemmSite(64, 64, torch.bfloat16, packable=False)
    stack.quantize(quantize_int8(torch.randn(3, 64, 64)))
    assert not TILED_W8A8.supports(stack, cpu)  # an expert stack has no second copy
    four = GemmSite(64, 64, torch.bfloat16, packable=True)
    four.quantize(quantize_int4(torch.randn(64, 64), 32))
    assert TILED_OVER_INT4.supports(four, cpu) and not TILED_W8A8.supports(four, cpu)
    four.bind((), (TILED_OVER_INT4,))
    assert four.quantized is not None and four.quantized.tiled is not None
    four.check_integrity(torch.empty(0))


@pytest.mark.parametrize("rows", [1, 7, 65, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("out_features", "in_features"), [(70, 256), (129, 100)])
def test_the_many_row_w8a8_runs_fused_to_the_bit(rows: int, dtype: torch.dtype, out_features: int,
                                                  in_features: int) -> None:  # fmt: skip
    """On the CPU `w8a8` quantizes its rows and scales the integer product in the fused kernels: the torch
    composition's values to the bit (a zero row, row widths and output counts off the vector length, a bias), on
    every thread count, and each row's result its own."""
    gen = torch.Generator().manual_seed(rows + in_features)
    q = quantize_int8(rand(gen, out_features, in_features, scale=0.1))
    x = strided(rand(gen, rows, in_features, dtype=dtype, scale=3.0))
    x[0] = 0
    b = rand(gen, out_features, dtype=dtype)
    want = w8a8(x, q, b)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            got = W8A8.apply(x, torch.empty(0), q, b)
            assert got.dtype == dtype and torch.equal(got, want), n
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(W8A8.apply(x[-1:], torch.empty(0), q, None), w8a8(x[-1:], q, None))


def test_the_fused_w8a8_steps_name_what_is_wrong() -> None:
    with pytest.raises(RuntimeError, match="unit-stride rows"):
        torch.ops.hyssm_cpu.quantize_rows(torch.randn(4, 8).t())
    with pytest.raises(RuntimeError, match="one float32 scale per row"):
        torch.ops.hyssm_cpu.scale_int32(torch.zeros(4, 8, dtype=torch.int32), torch.ones(3, 1), torch.ones(8),
                                        torch.bfloat16)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 out"):
        torch.ops.hyssm_cpu.scale_int32(torch.zeros(4, 8, dtype=torch.int32), torch.ones(4, 1), torch.ones(8),
                                        torch.float16)
