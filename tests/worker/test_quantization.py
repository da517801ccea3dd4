"""Quantized weights (worker_proc.quant.weight, worker_proc.loading.quantize): each format's error against
the weight it came from is within its rounding bound; every product of a format matches the format's
reference (the dequantized weight through F.linear) to the rounding its activations take; the products
claimed batch invariant are; a quantized model keeps routers and norms dense, drops the dense copies,
serves a tied embedding from the quantized rows, and its plan runs only its format's products."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.config import builtin_model_dir
from shared.errors import ModelLoadError
from worker_proc.kernels import native
from worker_proc.linear.kernels import (
    DEQUANT,
    FP8_BF16,
    FP8_SCALED,
    KERNELS,
    TILED_OVER_INT4,
    TILED_W4A8,
    TILED_W8A8,
    W4A16,
    W8A8,
    W8A16,
)
from worker_proc.linear.site import GemmSite
from worker_proc.loading.checkpoint import load_model
from worker_proc.loading.quantize import QuantScheme, quantize_model, quantize_weight
from worker_proc.plan.execution_plan import product_sites
from worker_proc.quant import weight as quantized
from worker_proc.quant.weight import QuantizedWeight, int4_dequantized, int4_values

G = torch.Generator().manual_seed(11)


def _weight(out: int = 96, inp: int = 128) -> torch.Tensor:
    w = torch.randn(out, inp, generator=G) * 0.02
    w[3] = 0.0  # an all-zero row must survive every format
    return w


def test_int8_rows_round_to_half_a_step() -> None:
    w = _weight()
    q = quantize_weight(w, "int8")
    q.check_integrity()
    step = w.abs().amax(1, keepdim=True) / 127
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-7).all()
    assert q.nbytes == w.numel() + 4 * w.shape[0]


def test_int4_groups_round_to_half_a_step() -> None:
    w = _weight()
    q = quantize_weight(w, "int4")
    q.check_integrity()
    assert q.fmt == "int4" and q.group == 32
    groups = w.view(96, -1, 32)
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    err = (q.dequantize() - w).view(96, -1, 32).abs().amax(-1)
    bf16_rounding = groups.abs().amax(-1) * 2**-7  # the scale and offset are held in bfloat16
    assert (err <= step / 2 + bf16_rounding).all()
    assert torch.equal(q.dequantize()[3], torch.zeros(128))


def test_an_int4_weights_int8_copy_is_within_half_an_int8_step_of_its_values() -> None:
    """The copy `tiled_over_int4` reads: the 4-bit values (read with bfloat16 scales), per row in int8."""
    q = quantize_weight(_weight(), "int4")
    values = int4_dequantized(int4_values(q), q.scale_bf16)  # (q - 8) s + z in float32, s and z in bfloat16
    assert torch.allclose(values.bfloat16().float(), q.dequantize(torch.bfloat16).float())
    step = values.abs().amax(1) / 127
    tiled = q.with_copy("tiled")
    assert tiled.tiled is not None and tiled.nbytes == q.nbytes + 96 * 128 + 4 * 96
    assert torch.allclose(tiled.tiled.scale, step, rtol=1e-6)
    if native.load():
        x = torch.eye(128)  # the int8 product of the identity reads the copy back exactly (a row scale of 1)
        copy = TILED_OVER_INT4.apply(x, torch.empty(0), tiled, None).t()
        assert ((copy - values).abs() <= step[:, None] / 2 + 1e-7).all()
        assert torch.equal(copy[3], torch.zeros(128))
    with pytest.raises(ValueError, match="int8 or int4"):
        quantize_weight(_weight(), "fp8").with_copy("tiled")
    with pytest.raises(ValueError, match="no quantized copy named 'dense'"):
        q.with_copy("dense")


def test_an_int4_weights_copies_are_made_a_slice_of_rows_at_a_time_with_the_same_values(
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A large LM head's float32 values whole would be gigabytes: they are made `DEQUANT_ROWS` rows at a time
    (three slices here, the last one short), with the values and the layout check of the whole matrix."""
    q = quantize_weight(_weight(), "int4")
    whole = q.with_copy("tiled").tiled
    monkeypatch.setattr(quantized, "DEQUANT_ROWS", 40)
    sliced = q.with_copy("tiled").tiled
    assert whole is not None and sliced is not None and torch.equal(sliced.scale, whole.scale)
    assert torch.equal(sliced.data, whole.data) and torch.equal(sliced.row_sums, whole.row_sums)
    monkeypatch.setattr(quantized, "unpack_int4", lambda data, out, inp: torch.zeros(out, inp, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="4-bit layout"):
        q.with_copy("tiled")


@pytest.mark.parametrize("fmt,method,tol", [("int8", W8A16, 1e-2), ("int8", W8A8, 2e-2),
                                            ("int8", TILED_W8A8, 2e-2), ("int4", W4A16, 1e-2),
                                            ("int4", TILED_OVER_INT4, 2e-2),
                                            ("int4", TILED_W4A8, 2e-2),
                                            ("fp8", FP8_BF16, 1e-2)])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_each_product_matches_its_format_reference(fmt: str, method, tol: float, rows: int) -> None:
    w = _weight()
    q = quantize_weight(w, fmt)
    if method.quantized_copy:
        q = q.with_copy(method.quantized_copy)
    if method.native and not native.load():
        pytest.skip("the fused CPU kernels cannot be built here")
    if method is TILED_W8A8:
        x0 = torch.randn(3, 128, generator=G)  # the same exact int32 product, another kernel and epilogue
        assert torch.allclose(method.apply(x0, w, q, None), W8A8.apply(x0, w, q, None), rtol=1e-6, atol=1e-7)
    bias = torch.randn(96, generator=G)
    x = torch.randn(rows, 128, generator=G)
    want = DEQUANT[fmt].apply(x, w, q, bias)
    assert torch.allclose(want, F.linear(x, q.dequantize(), bias), atol=1e-5)
    got = method.apply(x, w, q, bias)
    assert got.dtype == x.dtype and got.shape == (rows, 96)
    err = (got - want).abs().max() / want.abs().max()
    assert err <= tol, f"{method.name}: relative error {err:.2e}"


@pytest.mark.parametrize("method", [m for m in KERNELS.values() if m.batch_invariant and "cpu" in m.devices],
                         ids=lambda m: m.name)
def test_methods_claimed_batch_invariant_are(method) -> None:
    w = _weight()
    if method.native and not native.load():
        pytest.skip("the fused CPU kernels cannot be built here")
    stored = quantize_weight(w, method.storage) if method.storage in ("int8", "int4", "fp8") else None
    if method.quantized_copy:
        stored = stored.with_copy(method.quantized_copy)
    x = torch.randn(40, 128, generator=G)
    full = method.apply(x, w, stored, None)
    for rows in (1, 2, 3, 7, 16, 17, 39):
        assert torch.equal(method.apply(x[:rows], w, stored, None), full[:rows]), rows


def test_an_expert_stack_is_quantized_per_expert() -> None:
    stack = torch.randn(3, 32, 64, generator=G)
    for fmt in ("int8", "int4", "fp8"):
        q = quantize_weight(stack, fmt)
        assert q.experts == 3
        for e in range(3):
            one = quantize_weight(stack[e], fmt)
            assert torch.equal(q[e].dequantize(), one.dequantize()), (fmt, e)
        site = GemmSite(32, 64, torch.float32, packable=False)
        site.quantize(q)
        x = torch.randn(4, 64, generator=G)
        assert torch.allclose(site.apply_expert(x, torch.empty(0), 2), F.linear(x, q[2].dequantize()), atol=1e-5)


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_a_quantized_model_holds_only_quantized_products(fmt: str) -> None:
    model = load_model(builtin_model_dir(), dtype="float32")
    dense = {id(s): w.detach().clone() for _, s, w in product_sites(model)}
    report = quantize_model(model, QuantScheme(fmt))
    assert sum(report.sites.values()) == len(dense) and report.quantized_bytes < report.dense_bytes / 1.9
    for _, site, weight in product_sites(model):
        assert site.quantized is not None and weight.numel() == 0
        site.check_integrity(weight)
        err = (site.quantized.dequantize() - dense[id(site)]).abs().max() / dense[id(site)].abs().max()
        assert err < 0.1
    assert model.model.embed_tokens.weight.numel() == 0 and model.embed_rows is not None
    ids = torch.tensor([0, 5, 259])
    table = dense[id(model.head_gemm)]
    rows = model.embed_rows
    assert rows.fmt == ("fp8" if fmt == "fp8" else "int8")  # an int4 head keeps int8 rows for the lookups
    assert torch.allclose(model.embed(ids), rows.dequantize()[ids], atol=1e-7)
    step = table[ids].abs().amax(1, keepdim=True) * (2**-4 if fmt == "fp8" else 1 / 127)
    assert ((model.embed(ids) - table[ids]).abs() <= step).all()


def test_the_lm_head_can_stay_dense() -> None:
    model = load_model(builtin_model_dir(), dtype="float32")
    quantize_model(model, QuantScheme("int8", lm_head=False))
    assert model.head_gemm.quantized is None and model.embed_rows is None
    assert model.model.embed_tokens.weight.numel() > 0


def test_routers_stay_dense() -> None:
    site = GemmSite(8, 16, torch.float32, packable=False, quantizable=False)
    with pytest.raises(ValueError, match="model dtype"):
        site.quantize(QuantizedWeight("int8", torch.zeros(8, 16, dtype=torch.int8), torch.zeros(8), (8, 16)))


def test_a_site_refuses_a_method_of_another_storage() -> None:
    site = GemmSite(96, 128, torch.float32, packable=True)
    site.quantize(quantize_weight(_weight(), "int8"))
    with pytest.raises(ValueError, match="cannot read a int8 weight"):
        site.bind((), (KERNELS["dense"],))
    with pytest.raises(ValueError, match="cannot read a int8 weight"):
        site.bind((), (W4A16,))


def test_schemes_are_validated() -> None:
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        QuantScheme("int3")
    model = load_model(builtin_model_dir(), dtype="float32", device="meta")
    with pytest.raises(ModelLoadError, match="CPU only"):
        quantize_model(model, QuantScheme("int4"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt,method", [("int8", W8A8), ("fp8", FP8_SCALED)])
@pytest.mark.parametrize("rows", [1, 5, 17, 64])
def test_cuda_products_match_their_reference(fmt: str, method, rows: int) -> None:
    w = _weight(96, 128).cuda()
    q = quantize_weight(w, fmt)
    assert q.data.dtype == (torch.int8 if fmt == "int8" else torch.float8_e4m3fn)
    x = torch.randn(rows, 128, device="cuda")
    want = DEQUANT[fmt].apply(x, w, q, None)
    err = (method.apply(x, w, q, None) - want).abs().max() / want.abs().max()
    assert err <= 3e-2, f"{method.name} on CUDA: relative error {err:.2e}"
