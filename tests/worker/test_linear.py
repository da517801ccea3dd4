"""`layers.linear` and packed `Linear`: the split CPU GEMM used for few float32 rows and oneDNN-packed
weights give F.linear's results (to fp32 rounding) for every row count, thread count and output width;
the deterministic padding and the 16-bit and non-contiguous cases keep F.linear exactly; the model packs
its weights in the throughput mode only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker_proc.model.layers import (
    PACK_MIN_FLOAT32_ELEMENTS,
    PACK_ROWS,
    SPLIT_GEMM_MAX_ROWS,
    Linear,
    gemm_parts,
    linear,
    packing_supported,
    split_gemm,
    worth_packing,
)

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
        assert 1 <= parts <= max(2, threads) and n % parts == 0
    assert gemm_parts(12) == max(2, threads)  # 2 and 3 divide 12


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_matches_dense(dtype: torch.dtype) -> None:
    layer = Linear(40, 24, bias=True, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(24, 40, generator=G))
        layer.bias.copy_(torch.randn(24, generator=G))
    dense_w, dense_b = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.pack()
    assert layer.packed is not None and layer.weight.numel() == 0  # the dense copy is freed
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for rows in (1, 3, PACK_ROWS, 100):
        x = torch.randn(rows, 40, generator=G).to(dtype)
        want = F.linear(x.float(), dense_w.float(), dense_b.float())
        assert torch.allclose(layer(x).float(), want, rtol=tol, atol=tol * 10)
        assert torch.allclose(layer.matmul(x).float(), want - dense_b.float(), rtol=tol, atol=tol * 10)
    x3 = torch.randn(2, 5, 40, generator=G).to(dtype)
    assert layer(x3).shape == (2, 5, 24)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_kept_dense_copy_serves_one_row_products(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 keeps its dense copy and runs one-row products on it (split_gemm), every other row count
    packed; bfloat16 frees it whatever was asked."""
    from worker_proc.model import layers

    layer = Linear(40, 24, bias=True, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(24, 40, generator=G))
        layer.bias.copy_(torch.randn(24, generator=G))
    dense_w, dense_b = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.pack(keep_dense=True)
    assert layer.packed is not None
    assert layer.weight.numel() == (dense_w.numel() if dtype == torch.float32 else 0)
    calls: list[int] = []
    product = layers.packed_product
    monkeypatch.setattr(layers, "packed_product", lambda x, *a: (calls.append(x.shape[0]), product(x, *a))[1])
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for rows in (1, 2, PACK_ROWS):
        x = torch.randn(rows, 40, generator=G).to(dtype)
        want = F.linear(x.float(), dense_w.float(), dense_b.float())
        assert torch.allclose(layer(x).float(), want, rtol=tol, atol=tol * 10)
        assert torch.allclose(layer.matmul(x).float(), want - dense_b.float(), rtol=tol, atol=tol * 10)
    assert calls == ([2, 2, PACK_ROWS, PACK_ROWS] if dtype == torch.float32 else [1, 1, 2, 2, PACK_ROWS, PACK_ROWS])


def test_a_second_copy_only_where_the_host_can_spare_it() -> None:
    from worker_proc.host_memory import SPARE_COPY_FRACTION, copy_affordable, physical_memory_bytes

    host = 16 << 30
    assert copy_affordable(int(host * SPARE_COPY_FRACTION), physical=host)
    assert not copy_affordable(int(host * SPARE_COPY_FRACTION) + 1, physical=host)
    assert not copy_affordable(0, physical=host) and not copy_affordable(1, physical=0)
    assert physical_memory_bytes() > 0


def test_packing_refused_where_it_cannot_hold() -> None:
    layer = Linear(8, 8, bias=False)
    layer.min_rows = 16
    with pytest.raises(RuntimeError, match="batch invariant"):
        layer.pack()
    assert not packing_supported(torch.float16, torch.device("cpu"))
    assert not packing_supported(torch.float32, torch.device("meta"))


def test_only_weights_worth_it_are_packed() -> None:
    cpu = torch.device("cpu")
    small, big = torch.empty(256, 128), torch.empty(PACK_MIN_FLOAT32_ELEMENTS // 512, 512)
    assert not worth_packing(small) and worth_packing(big)
    assert worth_packing(small.bfloat16()) and not worth_packing(small.half())
    assert packing_supported(torch.float32, cpu)


def test_model_packs_in_throughput_mode_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.worker.util import fixture_dir
    from worker_proc.model import layers
    from worker_proc.runtime import ModelRunner

    small = ModelRunner(fixture_dir("rope_moe"), kv_slots=64, mamba_slots=2)
    assert not any(m.packed is not None for m in small.model.modules() if isinstance(m, Linear))  # all tiny
    monkeypatch.setattr(layers, "PACK_MIN_FLOAT32_ELEMENTS", 0)

    fast = ModelRunner(fixture_dir("rope_moe"), kv_slots=64, mamba_slots=2)
    linears = [m for m in fast.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None for m in linears)
    model = fast.model
    assert (model.lm_head is None) == (model.packed_embedding is not None)  # a tied head gets a packed copy
    assert model.model.embed_tokens.weight.numel()  # the table itself stays dense for the lookups
    with pytest.raises(RuntimeError, match="dense weights"):
        fast.model.set_batch_invariant(True)
    det = ModelRunner(fixture_dir("rope_moe"), kv_slots=64, mamba_slots=2, deterministic=True)
    assert all(m.packed is None and m.weight.numel() for m in det.model.modules() if isinstance(m, Linear))
    assert det.model.pack_weights() == 0


def test_split_rule_follows_the_weights_cache_residence(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model whose weights fit in half the last-level cache runs one-row products unsplit; a larger
    one, or one on a host that does not report its cache, splits them. Results match F.linear both ways."""
    from tests.worker.util import fixture_dir
    from worker_proc import host_memory, runtime
    from worker_proc.model import layers

    for index, (level, size) in enumerate([(1, "32K"), (2, "1024K"), (3, "32768K")]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "level").write_text(f"{level}\n")
        (tmp_path / f"index{index}" / "size").write_text(f"{size}\n")
    (tmp_path / "uevent").write_text("")
    assert host_memory.last_level_cache_bytes(str(tmp_path)) == 32 << 20
    assert host_memory.last_level_cache_bytes(str(tmp_path / "absent")) == 0
    assert host_memory.cache_resident(16 << 20, cache=32 << 20)
    assert not host_memory.cache_resident((16 << 20) + 1, cache=32 << 20)
    assert not host_memory.cache_resident(1, cache=0)

    calls: list[int] = []
    split = layers.split_gemm
    monkeypatch.setattr(layers, "split_gemm", lambda x, *a: (calls.append(x.shape[0]), split(x, *a))[1])
    for cache, split_rows in ((1 << 30, 0), (0, SPLIT_GEMM_MAX_ROWS)):
        monkeypatch.setattr(runtime, "cache_resident", lambda n, c=cache: host_memory.cache_resident(n, cache=c))
        runner = runtime.ModelRunner(fixture_dir("rope_moe"), kv_slots=64, mamba_slots=2)
        linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
        assert runner.model.split_rows == split_rows and all(m.split_rows == split_rows for m in linears)
        calls.clear()
        layer = linears[0]
        x = torch.randn(1, layer.in_features, generator=G)
        assert torch.allclose(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        assert calls == ([] if split_rows == 0 else [1])
