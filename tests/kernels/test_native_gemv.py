"""The fused few-row matrix products (`gemv`, `gemv_seq`: two orders of reading the weight) against F.linear,
and their place among the plan's methods."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.util import max_diff, rand, strided
from worker_proc.kernels import native
from worker_proc.model.gemm import GEMV, GEMV_SEQ, THROUGHPUT_METHODS, GemmMethod, GemmSite

pytestmark = pytest.mark.skipif(not native.load(), reason="the fused CPU kernels cannot be built here")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize(("out_features", "in_features"), [(64, 256), (37, 100), (6, 16), (200, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("method", [GEMV, GEMV_SEQ], ids=lambda m: m.name)
def test_gemv_equals_f_linear(rows: int, out_features: int, in_features: int, dtype: torch.dtype, bias: bool,
                              method: GemmMethod) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = strided(rand(gen, rows, in_features, dtype=dtype))  # a view with a row stride, as split projections are
    weight = rand(gen, out_features, in_features, dtype=dtype, scale=0.1)
    b = rand(gen, out_features, dtype=dtype) if bias else None
    got, want = method.apply(x, weight, None, b), F.linear(x, weight, b)
    assert got.dtype == dtype and got.shape == want.shape and got.is_contiguous()
    # float32 sums in another order: float32's rounding over the inner width, then one rounding to bf16
    ulp = 1e-6 * in_features if dtype == torch.float32 else 2**-7
    assert max_diff(got, want) <= 2 * ulp * max(1.0, float(want.abs().max()))


@pytest.mark.parametrize("method", [GEMV, GEMV_SEQ], ids=lambda m: m.name)
def test_gemv_runs_on_every_thread_count(method: GemmMethod) -> None:
    """However many threads share the weight's chunks, every output is the same to the bit (one thread
    computes each, in one order)."""
    gen = torch.Generator().manual_seed(3)
    x, weight = rand(gen, 10, 512), rand(gen, 1001, 512, scale=0.05)
    want = F.linear(x, weight)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(method.apply(x, weight, None, None))
            assert max_diff(outs[-1], want) <= 1e-4
        assert all(torch.equal(out, outs[0]) for out in outs)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("method", [GEMV, GEMV_SEQ], ids=lambda m: m.name)
def test_the_plan_measures_gemv_for_dense_float_weights_only(method: GemmMethod) -> None:
    assert method in THROUGHPUT_METHODS
    cpu = torch.device("cpu")
    assert method.supports(GemmSite(64, 64, torch.bfloat16, packable=True), cpu)
    assert method.supports(GemmSite(64, 64, torch.float32, packable=False), cpu)
    assert not method.supports(GemmSite(64, 64, torch.float16, packable=True), cpu)
    assert not method.supports(GemmSite(64, 64, torch.float32, packable=True), torch.device("meta"))
    assert method.max_rows == 64  # the plan times it at decode and batched-decode buckets only
