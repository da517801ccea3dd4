"""The product methods (`worker_proc.linear.kernels`): split, packed and padded give F.linear's results (to
fp32 rounding; padded exactly as F.linear over the padded rows) for every row count, thread count and
output width; a site dispatches by row count to the method bound for it; a Linear whose plan reads only
the packed copy drops its dense weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker_proc.kernels import native
from worker_proc.linear.kernels import (
    DENSE,
    MIN_GEMM_ROWS,
    PACKED,
    PACKED_ROW_STEP,
    PADDED,
    SPLIT,
    gemm_parts,
    pack_weight,
    packing_supported,
    split_gemm,
)
from worker_proc.linear.site import GemmSite
from worker_proc.model.layers import Linear
from worker_proc.plan.execution_plan import ExecutionPlan, GemmRule
from worker_proc.plan.product_timer import GemmKey, weight_bytes

G = torch.Generator().manual_seed(3)


@pytest.fixture(params=[1, 2, 3])
def threads(request: pytest.FixtureRequest):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 2, 5, 17])
@pytest.mark.parametrize("out_features", [1, 7, 12, 96])
def test_every_method_matches_f_linear(threads: int, rows: int, out_features: int) -> None:
    x = torch.randn(rows, 48, generator=G)
    w = torch.randn(out_features, 48, generator=G)
    b = torch.randn(out_features, generator=G)
    want = F.linear(x, w, b)
    packed = pack_weight(w)
    for method in (DENSE, SPLIT, PACKED, PADDED):
        got = method.apply(x, w, packed, b)
        assert got.shape == want.shape and got.is_contiguous(), method.name
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), method.name
        assert torch.allclose(method.apply(x, w, packed, None), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_packed_products_run_on_few_distinct_row_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN compiles and caches a primitive per row count: above PACKED_ROW_STEP rows the packed method
    pads to a multiple of it, and each real row's result is that of F.linear."""
    from worker_proc.linear import kernels as gemm

    seen: list[int] = []
    real = gemm.packed_product
    monkeypatch.setattr(gemm, "packed_product", lambda x, p, b: seen.append(x.shape[0]) or real(x, p, b))
    w, b = torch.randn(40, 48, generator=G), torch.randn(40, generator=G)
    packed = pack_weight(w)
    for rows in range(1, 3 * PACKED_ROW_STEP + 2):
        x = torch.randn(rows, 48, generator=G)
        got = PACKED.apply(x, w, packed, b)
        assert got.shape == (rows, 40) and torch.allclose(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert seen[:PACKED_ROW_STEP] == list(range(1, PACKED_ROW_STEP + 1))
    assert set(seen[PACKED_ROW_STEP:]) == {2 * PACKED_ROW_STEP, 3 * PACKED_ROW_STEP, 4 * PACKED_ROW_STEP}


def test_parts_divide_the_rows(threads: int) -> None:
    for n in (1, 7, 12, 96, 100352):
        parts = gemm_parts(n)
        assert 1 <= parts <= max(2, threads) and n % parts == 0
    assert gemm_parts(12) == max(2, threads)  # 2 and 3 divide 12


def test_split_gemm_uses_every_block() -> None:
    x = torch.randn(3, 16, generator=G)
    w = torch.randn(8, 16, generator=G)
    for parts in (1, 2, 4, 8):
        assert torch.allclose(split_gemm(x, w, parts), x @ w.t(), rtol=1e-5, atol=1e-5)


def test_padded_is_f_linear_over_the_padded_rows() -> None:
    x = torch.randn(3, 32, generator=G)
    w = torch.randn(64, 32, generator=G)
    padded = torch.cat([x, x.new_zeros(MIN_GEMM_ROWS - 3, 32)])
    assert torch.equal(PADDED.apply(x, w, None, None), F.linear(padded, w)[:3])
    assert PADDED.batch_invariant and not DENSE.batch_invariant


def test_which_methods_apply_where() -> None:
    cpu, meta = torch.device("cpu"), torch.device("meta")

    def site(dtype: torch.dtype, packable: bool = True) -> GemmSite:
        return GemmSite(8, 16, dtype, packable)

    assert SPLIT.supports(site(torch.float32), cpu) and not SPLIT.supports(site(torch.bfloat16), cpu)
    assert PACKED.supports(site(torch.bfloat16), cpu) and not PACKED.supports(site(torch.float32, False), cpu)
    assert not PACKED.supports(site(torch.float16), cpu)
    assert DENSE.supports(site(torch.float32), meta) and not PADDED.supports(site(torch.float32), meta)
    assert not packing_supported(torch.float32, meta)


def test_a_site_runs_the_method_bound_for_each_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(24, 40, generator=G)
    site = GemmSite(24, 40, torch.float32, packable=True)
    site.bind((1, 8), (SPLIT, DENSE, PACKED), w)
    assert [site.method_for(r).name for r in (1, 2, 8, 9, 1000)] == ["split", "dense", "dense", "packed", "packed"]
    for rows in (1, 5, 9):
        x = torch.randn(rows, 40, generator=G)
        assert torch.allclose(site.apply(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 5, 40, generator=G)
    assert site.apply(x3, w).shape == (2, 5, 24)
    site.check_integrity(w)
    with pytest.raises(ValueError, match="packed weight"):
        site.bind((), (PACKED,))
    with pytest.raises(ValueError, match="row bounds"):
        site.bind((4,), (DENSE,))


@pytest.mark.parametrize("copy", ["packed", "tiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_only_linear_drops_its_dense_weight(dtype: torch.dtype, copy: str) -> None:
    """A Linear whose rule reads only a copy of its weight (oneDNN's packed layout, the tiled one) keeps that
    copy alone and computes what F.linear does with the dense weight."""
    if copy == "tiled" and not native.load():
        pytest.skip("the fused CPU kernels cannot be built here")
    layer = Linear(40, 24, bias=True, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(24, 40, generator=G))
        layer.bias.copy_(torch.randn(24, generator=G))
    dense_w, dense_b = layer.weight.detach().clone(), layer.bias.detach().clone()
    key = GemmKey(24, 40, str(dtype).removeprefix("torch."))
    ExecutionPlan("throughput", {key: GemmRule((), (copy,))}).bind(layer)
    assert set(layer.gemm.copies) == {copy} and layer.weight.numel() == 0
    layer.gemm.check_integrity(layer.weight)
    # a one-row step's floor counts the copy the site reads (the tiled one padded to 32 rows)
    rows_read = 24 if copy == "packed" else 32
    assert weight_bytes([(layer.gemm, layer.weight)]) == rows_read * 40 * dense_w.element_size()
    # bound again to a rule that reads the dense weight, the layer gets it back from the copy, bit for bit
    ExecutionPlan("throughput", {key: GemmRule((), ("dense",))}).bind(layer)
    assert torch.equal(layer.weight, dense_w) and layer.gemm.copies == {}
    ExecutionPlan("throughput", {key: GemmRule((), (copy,))}).bind(layer)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for rows in (1, 3, 100) if copy == "packed" else (1, 3, 9):
        x = torch.randn(rows, 40, generator=G).to(dtype)
        want = F.linear(x.float(), dense_w.float(), dense_b.float())
        assert torch.allclose(layer(x).float(), want, rtol=tol, atol=tol * 10)
        assert torch.allclose(layer.matmul(x).float(), want - dense_b.float(), rtol=tol, atol=tol * 10)


def test_a_second_copy_only_where_the_host_can_spare_it() -> None:
    from worker_proc.host.memory import physical_memory_bytes
    from worker_proc.plan.method_choice import copy_affordable
    from worker_proc.plan.tuning import SPARE_COPY_FRACTION

    host = 16 << 30
    assert copy_affordable(int(host * SPARE_COPY_FRACTION), physical=host)
    assert not copy_affordable(int(host * SPARE_COPY_FRACTION) + 1, physical=host)
    assert not copy_affordable(0, physical=host) and not copy_affordable(1, physical=0)
    assert physical_memory_bytes() > 0
