"""`tiled_w4a8` (an int4 weight's tiled 4-bit copy times rows of x quantized to int8) against its arithmetic written
out in torch, to the bit; the copy's layout; reading torch's CPU 4-bit layout; its place among the plan's methods."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.util import rand, strided
from worker_proc.kernels import native
from worker_proc.linear.formats import THROUGHPUT_KERNELS
from worker_proc.linear.kernels import TILED_W4A8, W4A16, GemmKernel
from worker_proc.linear.site import GemmSite
from worker_proc.plan.method_choice import second_copy_bytes
from worker_proc.plan.product_timer import GemmKey
from worker_proc.quant import weight as quantized
from worker_proc.quant.layouts import tile_int4, unpack_int4
from worker_proc.quant.weight import (
    COPY_BYTES_PER_WEIGHT,
    QuantizedWeight,
    int4_dequantized,
    int4_values,
    quantize_int4,
    quantize_int8,
    quantize_rows,
)

pytestmark = pytest.mark.skipif(not native.load(), reason="the fused CPU kernels cannot be built here")


def _reference(x: torch.Tensor, q: QuantizedWeight) -> torch.Tensor:
    """The kernel's arithmetic in torch: exact group sums, then per group acc = fma(s, S, acc) and
    acc = fma(z - 8 s, X, acc) (each fused multiply-add exact in float64, then rounded once to float32),
    times the row's scale."""
    xq, xs = quantize_rows(x)
    values = int4_values(q).long()
    out, inp = q.shape
    groups = inp // q.group
    sums = (xq.long().view(-1, 1, groups, q.group) * values.view(1, out, groups, q.group)).sum(-1)
    group_x = xq.long().view(-1, groups, q.group).sum(-1)
    assert q.scale_bf16 is not None
    s, z = (q.scale_bf16[..., i].t().float() for i in (0, 1))
    offset = (z.double() - 8.0 * s.double()).float()
    acc = torch.zeros(x.shape[0], out)
    for g in range(groups):
        acc = (s[:, g].double() * sums[..., g].double() + acc.double()).float()
        acc = (offset[:, g].double() * group_x[:, g, None].double() + acc.double()).float()
    return acc * xs.view(-1, 1)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 17])
@pytest.mark.parametrize(("out_features", "in_features", "group"), [(80, 96, 32), (48, 256, 64), (208, 128, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_w4a8_is_its_arithmetic_to_the_bit(rows: int, out_features: int, in_features: int, group: int,
                                                 dtype: torch.dtype) -> None:
    """Every row count (passes of eight rows and a remainder, one to three blocks a pass), a zero row, torch's
    layout with and without its tail of out % 64 rows; each row's result that of the row alone."""
    gen = torch.Generator().manual_seed(rows * 100 + out_features)
    q = quantize_int4(rand(gen, out_features, in_features, scale=0.1), group).with_copy("tiled4")
    x = strided(rand(gen, rows, in_features, dtype=dtype))
    x[0] = 0
    b = rand(gen, out_features, dtype=dtype)
    got = TILED_W4A8.apply(x, torch.empty(0), q, b)
    assert got.dtype == dtype and torch.equal(got, _reference(x.float(), q).to(dtype) + b)
    assert torch.equal(TILED_W4A8.apply(x[-1:], torch.empty(0), q, b), got[-1:])
    want = W4A16.apply(x.bfloat16(), torch.empty(0), q, b.bfloat16()).float()
    assert (got.float() - want).abs().max() <= 0.02 * want.abs().max()  # torch's 4-bit product, x unrounded


def test_the_tiled_int4_product_is_the_same_on_every_thread_count() -> None:
    gen = torch.Generator().manual_seed(5)
    q = quantize_int4(rand(gen, 1008, 256, scale=0.05), 32).with_copy("tiled4")
    x = rand(gen, 11, 256, dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(TILED_W4A8.apply(x, torch.empty(0), q, None))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(r, results[0]) for r in results)


def test_torchs_4bit_layout_is_read_back_value_for_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """The values torch packed come back (blocks of 64 rows and the tail of 16-48); a layout read wrong fails the
    check against torch's own kernel instead of giving a wrong product."""
    gen = torch.Generator().manual_seed(6)
    for out in (64, 80, 112, 176):
        values = torch.randint(0, 16, (out, 96), generator=gen, dtype=torch.int32)
        packed = torch._convert_weight_to_int4pack_for_cpu(values, 1)
        assert torch.equal(unpack_int4(packed, out, 96), values.to(torch.uint8)), out
    q = quantize_int4(rand(gen, 80, 96), 32)
    values = int4_values(q)
    read = int4_dequantized(values, q.scale_bf16).bfloat16().float()
    assert torch.allclose(read, q.dequantize(torch.bfloat16).float())
    monkeypatch.setattr(quantized, "unpack_int4", lambda data, out, inp: unpack_int4(data, out, inp).flip(1))
    with pytest.raises(RuntimeError, match="4-bit layout"):  # as a torch packing its values otherwise would
        int4_values(q)


def test_a_tiled_4bit_copy_holds_eight_inputs_of_sixteen_rows_per_vector() -> None:
    gen = torch.Generator().manual_seed(7)
    q = quantize_int4(rand(gen, 48, 64), 32)
    values = int4_values(q)
    tiles = tile_int4(values, q.scale_bf16)
    assert tuple(tiles.data.shape) == (3, 8, 16, 4) and tiles.data.dtype == torch.uint8
    byte = tiles.data[1, 2, 5]  # block 1 (rows 16-31), inputs 16-23, its row 5
    assert torch.equal(byte & 15, values[21, 16:20]) and torch.equal(byte >> 4, values[21, 20:24])
    assert tuple(tiles.scales.shape) == (3, 2, 2, 16) and tiles.scales.dtype == torch.bfloat16
    assert torch.equal(tiles.scales[2, 1, 0], q.scale_bf16[1, 32:48, 0])  # block 2, group 1: the rows' s
    assert torch.equal(tiles.scales[2, 1, 1], q.scale_bf16[1, 32:48, 1])  # and their z
    copy = q.with_copy("tiled4")
    assert copy.nbytes == q.nbytes + 48 * 64 // 2 + 2 * 3 * 2 * 2 * 16
    with pytest.raises(ValueError, match="only an int4 matrix"):
        quantize_int8(rand(gen, 48, 64)).with_copy("tiled4")


def test_the_tiled_w4a8_kernel_names_what_is_wrong() -> None:
    q = quantize_int4(torch.randn(32, 64), 32).with_copy("tiled4")
    t = q.tiled4
    assert t is not None
    with pytest.raises(RuntimeError, match="tiled as"):
        torch.ops.hyssm_cpu.tiled_w4a8(torch.randn(2, 60), t.data, t.scales, 32)
    with pytest.raises(RuntimeError, match="scales"):
        torch.ops.hyssm_cpu.tiled_w4a8(torch.randn(2, 64), t.data, t.scales.float(), 32)
    with pytest.raises(RuntimeError, match="outputs"):
        torch.ops.hyssm_cpu.tiled_w4a8(torch.randn(2, 64), t.data, t.scales, 33)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.hyssm_cpu.tiled_w4a8(torch.randn(2, 64).half(), t.data, t.scales, 32)


def test_the_plan_offers_the_tiled_int4_product_to_single_int4_matrices_and_counts_its_copy() -> None:
    cpu = torch.device("cpu")
    four = GemmSite(64, 64, torch.bfloat16, packable=True)
    four.quantize(quantize_int4(torch.randn(64, 64), 32))
    assert TILED_W4A8.supports(four, cpu) and TILED_W4A8 in THROUGHPUT_KERNELS and TILED_W4A8.batch_invariant
    eight = GemmSite(64, 64, torch.bfloat16, packable=True)
    eight.quantize(quantize_int8(torch.randn(64, 64)))
    stack = GemmSite(64, 64, torch.bfloat16, packable=False)
    stack.quantize(quantize_int4(torch.randn(3, 64, 64), 32))
    assert not TILED_W4A8.supports(eight, cpu) and not TILED_W4A8.supports(stack, cpu)
    four.bind((), (TILED_W4A8,))
    held = four.quantized
    assert held is not None and held.tiled4 is not None and held.tiled is None
    four.check_integrity(torch.empty(0))
    key = GemmKey.of(four)
    assert second_copy_bytes(key, ["tiled_w4a8"], 2, 0) == 2 * 64 * 64 * COPY_BYTES_PER_WEIGHT["tiled4"]
    assert isinstance(TILED_W4A8, GemmKernel) and TILED_W4A8.quantized_copy == "tiled4"
