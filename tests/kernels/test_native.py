"""The fused CPU kernels (`NativeOps`) against the reference ops, and the kernel selection around them."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.kernels.util import TOL, max_diff, pool, rand, strided, untouched
from worker_proc.kernels import FastOps, ReferenceOps, native
from worker_proc.kernels import state_codec as codec
from worker_proc.kernels.interface import SsdParams
from worker_proc.model.layers import GatedRMSNorm, RMSNorm, UnitOffsetRMSNorm
from worker_proc.plan import kernel_set as select

pytestmark = pytest.mark.skipif(not native.load(), reason="the fused CPU kernels cannot be built here")


def _native():  # imported here: the class exists only where the library loads
    from worker_proc.kernels.native.ops import NativeOps

    return NativeOps()


def _mamba_inputs(gen: torch.Generator, rows: int, heads: int, p: int, groups: int, n: int, k: int, dtype,
                  limit=(0.0, float("inf")), bias: bool = True):  # fmt: skip
    cd = heads * p + 2 * groups * n
    proj = rand(gen, rows, cd + heads + 5, dtype=dtype)  # xBC and dt as views of one in_proj row, as in the mixer
    params = SsdParams(-torch.rand(heads, generator=gen) - 0.1, rand(gen, heads, dtype=dtype),
                       rand(gen, heads, dtype=dtype), limit, 64)  # fmt: skip
    return dict(
        xbc=proj[:, :cd], dt=proj[:, cd : cd + heads], conv_pool=pool(gen, 6, cd, k - 1, zero=(2,), dtype=dtype),
        weight=rand(gen, cd, k, dtype=dtype, scale=0.5), bias=rand(gen, cd, dtype=dtype) if bias else None,
        p=params, ssm_pool=pool(gen, 6, heads, p, n, zero=(3,)),
    )  # fmt: skip


@pytest.mark.parametrize(("heads", "groups", "head_group", "limit", "bias"), [
    (4, 1, None, (0.0, float("inf")), True),
    (6, 2, None, (0.05, 1.5), False),
    (4, 2, (0, 0, 0, 1), (0.0, float("inf")), True),  # heads spread unevenly over this rank's groups (TP)
])  # fmt: skip
def test_fused_mamba_step_equals_the_reference(gen: torch.Generator, heads: int, groups: int, head_group, limit,
                                               bias: bool) -> None:  # fmt: skip
    t = _mamba_inputs(gen, 3, heads, 8, groups, 16, 4, torch.float32, limit, bias)
    slots = torch.tensor([5, 2, 3])
    hg = None if head_group is None else torch.tensor(head_group)
    want = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in t.items()}
    got = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in t.items()}
    y_ref = ReferenceOps().mamba_decode(want["xbc"], want["dt"], want["conv_pool"], slots, want["weight"],
                                        want["bias"], want["p"], want["ssm_pool"], groups, hg)  # fmt: skip
    y = _native().mamba_decode(got["xbc"], got["dt"], got["conv_pool"], slots, got["weight"], got["bias"], got["p"],
                               got["ssm_pool"], groups, hg)  # fmt: skip
    assert y.dtype == torch.float32 and y.shape == (3, heads, 8)
    assert max_diff(y, y_ref) <= TOL
    assert max_diff(got["ssm_pool"], want["ssm_pool"]) <= TOL
    assert torch.equal(got["conv_pool"], want["conv_pool"])  # the window shift is exact
    for name in ("ssm_pool", "conv_pool"):
        assert untouched(t[name], got[name], [5, 2, 3])


@pytest.mark.parametrize(("heads", "p", "n", "k"), [(20, 8, 20, 4), (18, 6, 36, 3)])
def test_fused_mamba_step_over_several_conv_blocks_and_partial_vectors(gen: torch.Generator, heads: int, p: int,
                                                                       n: int, k: int) -> None:  # fmt: skip
    """A conv wider than one task's block of channels (the last block partial), state rows whose width is
    not a multiple of the vector, and a head dimension not a multiple of four, still equal the reference."""
    t = _mamba_inputs(gen, 3, heads, p, 1, n, k, torch.float32)
    assert t["xbc"].shape[1] > 128
    slots = torch.tensor([4, 1, 3])
    want = {key: v.clone() if isinstance(v, torch.Tensor) else v for key, v in t.items()}
    got = {key: v.clone() if isinstance(v, torch.Tensor) else v for key, v in t.items()}
    y_ref = ReferenceOps().mamba_decode(want["xbc"], want["dt"], want["conv_pool"], slots, want["weight"],
                                        want["bias"], want["p"], want["ssm_pool"], 1, None)  # fmt: skip
    y = _native().mamba_decode(got["xbc"], got["dt"], got["conv_pool"], slots, got["weight"], got["bias"], got["p"],
                               got["ssm_pool"], 1, None)  # fmt: skip
    assert max_diff(y, y_ref) <= TOL and max_diff(got["ssm_pool"], want["ssm_pool"]) <= TOL
    assert torch.equal(got["conv_pool"], want["conv_pool"])
    for name in ("ssm_pool", "conv_pool"):
        assert untouched(t[name], got[name], [4, 1, 3])


def test_fused_mamba_step_in_bfloat16_rounds_as_the_fast_kernels(gen: torch.Generator) -> None:
    """A bfloat16 model: conv outputs rounded to bfloat16 as the torch path rounds them, the state float32."""
    t = _mamba_inputs(gen, 2, 4, 8, 1, 16, 4, torch.bfloat16)
    slots = torch.tensor([1, 4])
    fast, mine = t["ssm_pool"].clone(), t["ssm_pool"].clone()
    conv_fast, conv_mine = t["conv_pool"].clone(), t["conv_pool"].clone()
    y_fast = FastOps().mamba_decode(t["xbc"], t["dt"], conv_fast, slots, t["weight"], t["bias"], t["p"], fast, 1, None)
    y = _native().mamba_decode(t["xbc"], t["dt"], conv_mine, slots, t["weight"], t["bias"], t["p"], mine, 1, None)
    assert torch.equal(conv_mine, conv_fast)
    scale = float(y_fast.abs().max())
    assert max_diff(y, y_fast) <= 2e-2 * scale and max_diff(mine, fast) <= 2e-2 * float(fast.abs().max())


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_a_narrow_state_pool_is_read_and_stored_in_its_encoding(gen: torch.Generator, state_dtype: str) -> None:
    """bfloat16 and int8 pools through the fused step and the fused scan: the float32 result of the same
    update, stored as state_codec stores it (one rounding or quantisation step at most apart)."""
    t = _mamba_inputs(gen, 2, 4, 8, 1, 16, 4, torch.float32)
    slots = torch.tensor([1, 4])

    def encoded(states: torch.Tensor):
        if state_dtype == "int8":
            return codec.QuantizedPool(*codec.quantize(states))
        return states.to(torch.bfloat16)

    want_f32 = t["ssm_pool"].clone()
    y_ref = ReferenceOps().mamba_decode(t["xbc"], t["dt"], t["conv_pool"].clone(), slots, t["weight"], t["bias"],
                                        t["p"], want_f32, 1, None)  # fmt: skip
    start = encoded(t["ssm_pool"])
    mine = encoded(t["ssm_pool"])
    ref_from_stored = codec.load(start, torch.arange(7)).clone()
    ReferenceOps().mamba_decode(t["xbc"], t["dt"], t["conv_pool"].clone(), slots, t["weight"], t["bias"], t["p"],
                                ref_from_stored, 1, None)  # fmt: skip
    y = _native().mamba_decode(t["xbc"], t["dt"], t["conv_pool"].clone(), slots, t["weight"], t["bias"], t["p"],
                               mine, 1, None)  # fmt: skip
    got = codec.load(mine, torch.arange(7))
    step = float(ref_from_stored.abs().max()) / (127 if state_dtype == "int8" else 128)
    assert max_diff(got, ref_from_stored) <= step  # the update of the stored state, stored again
    assert max_diff(y, y_ref) <= 0.05 * float(y_ref.abs().max())  # the stored state's own error, no more
    assert torch.equal(got[[0, 2, 3, 5, 6]], codec.load(start, torch.arange(7))[[0, 2, 3, 5, 6]])


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_a_narrow_state_pool_through_a_long_prefill_segment(gen: torch.Generator, state_dtype: str) -> None:
    """The prefill scan's blocked path reads a narrow pool once and stores it once: the float32 scan from
    the stored state, stored as state_codec stores it."""
    heads, p, n, length = 2, 16, 32, 45
    x, dt = rand(gen, length, heads, p), rand(gen, length, heads)
    b, c = rand(gen, length, 1, n), rand(gen, length, 1, n)
    params = SsdParams(-torch.rand(heads, generator=gen) - 0.1, rand(gen, heads), rand(gen, heads), (0.0, 10.0), 16)
    states = pool(gen, 3, heads, p, n)
    stored = codec.QuantizedPool(*codec.quantize(states)) if state_dtype == "int8" else states.to(torch.bfloat16)
    want = codec.load(stored, torch.arange(4)).clone()
    y_ref = ReferenceOps().ssd_prefill_many(x, dt, b, c, params, want, ((length, 2),))
    y = _native().ssd_prefill_many(x, dt, b, c, params, stored, ((length, 2),))
    got = codec.load(stored, torch.arange(4))
    step = float(want.abs().max()) / (127 if state_dtype == "int8" else 128)
    assert max_diff(y, y_ref) <= TOL * max(1.0, float(y_ref.abs().max()))
    assert max_diff(got[2], want[2]) <= step
    assert torch.equal(got[[0, 1, 3]], codec.load(codec.QuantizedPool(*codec.quantize(states)) if state_dtype == "int8"
                                                  else states.to(torch.bfloat16), torch.arange(4))[[0, 1, 3]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("fused", [True, False])
def test_fused_gated_activation_equals_the_composed_one(gen: torch.Generator, dtype, rows: int, fused: bool) -> None:
    """silu(gate) * up with torch's roundings: float32 to its rounding, bfloat16 within one rounding of the
    SiLU (another exponential can round it the other way). `fused`: gate and up are the halves of one
    projection's output, read from a view with a row stride (as the projection's rows may be); else two
    tensors of their own, each with its own row stride (a split gated MLP's two products)."""
    if fused:
        gate, up = strided(rand(gen, rows, 2 * 1100, dtype=dtype, scale=4.0)).chunk(2, dim=-1)
    else:
        gate = strided(rand(gen, rows, 1100, dtype=dtype, scale=4.0))
        up = rand(gen, rows, 1100 + 7, dtype=dtype, scale=4.0)[:, 7:]
        assert gate.stride(0) != up.stride(0)
    want = FastOps().silu_mul(gate, up)
    got = _native().silu_mul(gate, up)
    assert got.dtype == dtype and got.shape == (rows, 1100) and got.is_contiguous()
    scale = float(want.abs().max())
    assert max_diff(got, want) <= (TOL if dtype == torch.float32 else 2**-7) * scale
    if dtype == torch.bfloat16:  # one rounding apart at most, and mostly none
        assert (got != want).float().mean() < 0.05


def test_fused_gated_activation_refuses_mismatched_halves() -> None:
    """gate and up of different shapes are refused by the op with the problem named."""
    gate, up = torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(2, 9, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="gate and up must share a shape"):
        torch.ops.hyssm_cpu.silu_mul(gate, up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("width", "k", "bias"), [(40, 3, True), (300, 4, False), (7, 2, True)])
def test_fused_short_conv_step_equals_the_composed_one(gen: torch.Generator, dtype, width: int, k: int,
                                                       bias: bool) -> None:  # fmt: skip
    """LFM2's step (C * conv(B * x), the windows advanced) against the reference's composition, from a
    projection's rows with a row stride: float32 to its rounding, bfloat16 within one rounding of the conv
    (the reference rounds each product before the sum). The windows keep B * x exactly as the reference
    does; slots outside the step untouched."""
    bcx = strided(rand(gen, 3, 3 * width, dtype=dtype))
    weight = rand(gen, width, k, dtype=dtype, scale=0.5)
    b = rand(gen, width, dtype=dtype) if bias else None
    conv_pool = pool(gen, 6, width, k - 1, zero=(2,), dtype=dtype)
    slots = torch.tensor([5, 2, 3])
    want_pool, got_pool = conv_pool.clone(), conv_pool.clone()
    want = ReferenceOps().short_conv_decode(bcx, want_pool, slots, weight, b)
    got = _native().short_conv_decode(bcx, got_pool, slots, weight, b)
    assert got.dtype == dtype and got.shape == (3, width) and got.is_contiguous()
    scale = max(1.0, float(want.abs().max()))
    assert max_diff(got, want) <= (TOL if dtype == torch.float32 else 2**-6) * scale
    assert torch.equal(got_pool, want_pool)
    assert untouched(conv_pool, got_pool, [5, 2, 3])


def test_fused_short_conv_step_refuses_a_mismatched_pool() -> None:
    """A pool whose window does not match the weight's width is refused with the problem named."""
    bcx = torch.ones(2, 12, dtype=torch.bfloat16)
    weight = torch.ones(4, 3, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="conv pool must be a contiguous"):
        torch.ops.hyssm_cpu.short_conv_decode(bcx, torch.zeros(3, 4, 3, dtype=torch.bfloat16), torch.tensor([1, 2]),
                                              weight, None)  # fmt: skip


@pytest.mark.parametrize("before_gate", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_gate_norm_equals_the_module(gen: torch.Generator, before_gate: bool, dtype) -> None:
    norm = GatedRMSNorm(24, 3, 1e-5, dtype, torch.device("cpu"), before_gate)
    norm.weight.data = rand(gen, 24, dtype=dtype)
    y, z = rand(gen, 5, 24), strided(rand(gen, 5, 24, dtype=dtype))
    assert max_diff(_native().gate_norm(y, z, norm), norm(y, z)) <= TOL
    assert max_diff(_native().gate_norm(y, z, None), ReferenceOps().gate_norm(y, z, None)) <= TOL
    for weighted in (norm, None):  # written in the model dtype: the float32 result rounded once, as `.to` does
        rounded = _native().gate_norm(y, z, weighted, dtype)
        assert rounded.dtype == dtype and torch.equal(rounded, _native().gate_norm(y, z, weighted).to(dtype))


@pytest.mark.parametrize("kind", ["rms", "rms_fp32_weight", "unit_offset"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rms_norm_equals_the_module(gen: torch.Generator, kind: str, dtype) -> None:
    cpu = torch.device("cpu")
    norm = UnitOffsetRMSNorm(64, 1e-6, dtype, cpu) if kind == "unit_offset" else RMSNorm(
        64, 1e-6, dtype, cpu, fp32_weight=kind == "rms_fp32_weight")
    norm.weight.data = rand(gen, 64, dtype=dtype)
    x = strided(rand(gen, 7, 64, dtype=dtype, scale=3.0))
    got, want = _native().rms_norm(norm, x), norm(x)
    assert got.dtype == dtype and got.shape == want.shape
    # float32 statistics summed in another order: at most one rounding step of the output dtype apart
    ulp = 1e-6 if dtype == torch.float32 else 2 ** -7
    assert max_diff(got, want) <= 2 * ulp * float(want.abs().max())


@pytest.mark.parametrize("multiplier", [1.0, 0.22])
@pytest.mark.parametrize("kind", ["rms", "rms_fp32_weight", "unit_offset"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_add_and_norm_in_one_pass_equal_the_add_then_the_norm(gen: torch.Generator, kind: str, dtype,
                                                                     multiplier: float) -> None:  # fmt: skip
    """The stream after the add is torch.add's to the bit (the multiplier rounded to the dtype as torch
    rounds it); the norm of it is the fused norm's; a float32 `RMSNorm` keeps torch's own call."""
    cpu = torch.device("cpu")
    norm = UnitOffsetRMSNorm(96, 1e-6, dtype, cpu) if kind == "unit_offset" else RMSNorm(
        96, 1e-6, dtype, cpu, fp32_weight=kind == "rms_fp32_weight")
    norm.weight.data = rand(gen, 96, dtype=dtype)
    h, y = rand(gen, 9, 96, dtype=dtype, scale=3.0), strided(rand(gen, 9, 96, dtype=dtype))
    ops = _native()
    summed, x = ops.add_rms_norm(norm, h, y, multiplier)
    want = h + y if multiplier == 1.0 else torch.add(h, y, alpha=multiplier)
    assert torch.equal(summed, want)
    assert torch.equal(x, ops.rms_norm(norm, want))
    composed = FastOps().add_rms_norm(norm, h, y, multiplier)
    assert torch.equal(composed[0], want) and torch.equal(composed[1], FastOps().rms_norm(norm, want))


def test_scan_constants_are_widened_again_when_written() -> None:
    """A reduced-precision D or dt_bias is widened once, and again after it is written (a reload)."""
    ops = _native()
    d = torch.tensor([0.5, -1.25], dtype=torch.bfloat16)
    first = ops._f32(d)
    assert first.dtype == torch.float32 and torch.equal(first, d.float()) and ops._f32(d) is first
    d.mul_(2)
    assert torch.equal(ops._f32(d), d.float())
    same = torch.ones(2)
    assert ops._f32(same) is same


def test_the_cpu_takes_the_fused_kernels_or_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    assert select.choose_kernels("cpu").ops == "native"
    assert select.choose_kernels("cpu", deterministic=True).ops == "reference"
    with pytest.raises(ValueError, match="not batch invariant"):
        select.choose_kernels("cpu", "native", deterministic=True)
    monkeypatch.setattr(native, "_load", lambda: (False, "no compiler found"))
    fallback = select.choose_kernels("cpu")
    assert fallback.ops == "fast" and "no compiler found" in fallback.describe()
    with pytest.raises(ValueError, match="no compiler found"):
        select.choose_kernels("cpu", "native")


@pytest.mark.parametrize(("groups", "limit", "dtype"), [
    (1, (0.0, float("inf")), torch.float32),
    (2, (0.05, 1.5), torch.float32),
    (2, (0.0, float("inf")), torch.bfloat16),
])  # fmt: skip
@pytest.mark.parametrize(("p", "n"), [
    (8, 16), (6, 37),  # token by token only: rows past the last four, state past the last 16
    (16, 32), (32, 48),  # a long segment's whole blocks in vector lanes, its tail token by token
])  # fmt: skip
def test_prefill_scan_equals_the_chunked_reference(gen: torch.Generator, groups: int, limit, dtype, p: int,
                                                   n: int) -> None:  # fmt: skip
    heads = 4
    spans = ((13, 5), (1, 2), (70, 3))  # a segment longer than a chunk, a one-token one, a fresh slot (3)
    total = sum(length for length, _ in spans)
    x, dt = strided(rand(gen, total, heads, p, dtype=dtype)), strided(rand(gen, total, heads, dtype=dtype))
    b, c = strided(rand(gen, total, groups, n, dtype=dtype)), strided(rand(gen, total, groups, n, dtype=dtype))
    params = SsdParams(-torch.rand(heads, generator=gen) - 0.1, rand(gen, heads), rand(gen, heads), limit, 16)
    start = pool(gen, 6, heads, p, n, zero=(3,))
    want, got = start.clone(), start.clone()
    y_ref = ReferenceOps().ssd_prefill_many(x, dt, b, c, params, want, spans)
    y = _native().ssd_prefill_many(x, dt, b, c, params, got, spans)
    assert y.dtype == torch.float32 and y.shape == y_ref.shape
    assert max_diff(y, y_ref) <= TOL * max(1.0, float(y_ref.abs().max()))
    assert max_diff(got, want) <= TOL * max(1.0, float(want.abs().max()))
    assert untouched(start, got, [5, 2, 3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("silu, k", [(True, 4), (False, 4), (False, 3)])  # without SiLU: a short conv (LFM2's K = 3)
def test_one_conv_call_over_segments_equals_the_reference(gen: torch.Generator, dtype, with_bias: bool, silu: bool,
                                                          k: int) -> None:  # fmt: skip
    """Segments longer and shorter than the window (2 < K-1 = 3), each continuing from its own slot."""
    cd = 300  # more channels than one block of the kernel
    spans = ((9, 4), (2, 1), (1, 6), (5, 3))
    total = sum(length for length, _ in spans)
    x = strided(rand(gen, total, cd, dtype=dtype))
    weight, bias = rand(gen, cd, k, dtype=dtype, scale=0.5), rand(gen, cd, dtype=dtype) if with_bias else None
    start = pool(gen, 6, cd, k - 1, zero=(3,), dtype=dtype)
    want, got = start.clone(), start.clone()
    out_ref = ReferenceOps().conv_prefill_many(x, want, spans, weight, bias, silu)
    out = _native().conv_prefill_many(x, got, spans, weight, bias, silu)
    assert out.dtype == dtype and out.shape == out_ref.shape
    tol = TOL if dtype == torch.float32 else 2 ** -6 * float(out_ref.abs().max())
    assert max_diff(out, out_ref) <= tol
    assert torch.equal(got, want)  # the windows hold inputs: copied, never rounded
    assert untouched(start, got, [4, 1, 6, 3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 24])  # a multiple of the vector width, and not
def test_fused_decode_attention_reads_each_context_at_its_own_slots(gen: torch.Generator, dtype, head_dim) -> None:
    """Requests of several lengths (one of them over several chunks of keys, whose partial softmaxes
    are combined), slots scattered over the pools and the rows padded with slot 0 past each length:
    the reference's float32 attention over exactly each request's slots; in bfloat16 no further from
    it than the flash kernel the fast kernels call (or than one rounding of the output)."""
    from worker_proc.kernels import reference as ref

    k_pool, v_pool = rand(gen, 1201, 2, head_dim, dtype=dtype), rand(gen, 1201, 2, head_dim, dtype=dtype)
    lengths = [1, 37, 250, 1100]
    kv_idx = torch.zeros(4, 1100, dtype=torch.int64)
    for b, n in enumerate(lengths):
        kv_idx[b, :n] = torch.randperm(1200, generator=gen)[:n] + 1
    lens = torch.tensor(lengths)
    q = rand(gen, 4, 6, head_dim, dtype=dtype)
    q[3, 1] *= 40.0  # a sharply peaked softmax: the chunks' maxima differ by far
    out = _native().attn_decode(q, k_pool, v_pool, kv_idx, lens, 0.2)
    assert out.dtype == dtype and out.shape == (4, 6, head_dim)
    want = ref.attention_decode(q.float(), k_pool[kv_idx].float(), v_pool[kv_idx].float(), lens, 0.2)
    if dtype == torch.float32:
        assert max_diff(out, want) <= TOL
    else:
        flash = FastOps().attn_decode(q, k_pool, v_pool, kv_idx, lens, 0.2)
        assert max_diff(out, want) <= max(max_diff(flash, want), 2.0**-7)
    bad = kv_idx.clone()
    bad[1, 5] = 1201
    with pytest.raises(RuntimeError, match="outside the pools"):
        _native().attn_decode(q, k_pool, v_pool, bad, lens, 0.2)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """Float64 attention of q [L, H, d] (positions start..) over k, v [start + L, kvh, d], causal."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    s = torch.einsum("lhd,thd->hlt", q.double(), k) * scale
    future = torch.arange(k.shape[0])[None, :] > (start + torch.arange(q.shape[0]))[:, None]
    return torch.einsum("hlt,thd->lhd", s.masked_fill(future, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("length", "start", "heads", "kv_heads", "head_dim"), [
    (37, 0, 6, 2, 64),  # a first chunk, shorter than one block of queries or keys
    (100, 300, 12, 4, 64),  # a later chunk: the cached part in full, the chunk's own keys causally
    (5, 1000, 8, 1, 128),  # one KV head for every query head, a wider head
    (7, 90, 4, 2, 256),  # Qwen3-Next's and Qwen3.5's head width: four tiles of the output per row
    (64, 64, 4, 4, 64),  # chunk and context on block boundaries
    (20, 10, 4, 2, 48),  # a head width the kernel does not take: the fast kernels' call
])  # fmt: skip
def test_fused_prefill_attention_is_causal_over_the_context_at_its_slots(gen: torch.Generator, dtype, length: int,
                                                                         start: int, heads: int, kv_heads: int,
                                                                         head_dim: int) -> None:  # fmt: skip
    """Queries at positions start.. over a context scattered over the pools: float64 causal attention
    over exactly those slots (float32 within TOL; bfloat16 no further from it than the flash kernel the
    fast kernels call, or one rounding of the output), a sharply peaked row included."""
    slots = start + length + 50
    k_pool = rand(gen, slots, kv_heads, head_dim, dtype=dtype)
    v_pool = rand(gen, slots, kv_heads, head_dim, dtype=dtype)
    kv_idx = torch.randperm(slots, generator=gen)[: start + length]
    q = rand(gen, length, heads, head_dim, dtype=dtype)
    q[length // 2, 0] *= 30.0  # one row's weight on a single key: the running maximum jumps
    out = _native().attn_prefill(q, k_pool, v_pool, kv_idx, start, 0.125)
    assert out.dtype == dtype and out.shape == q.shape
    want = _causal_attention(q, k_pool[kv_idx], v_pool[kv_idx], start, 0.125)
    if dtype == torch.float32:
        assert max_diff(out, want) <= TOL
    else:
        flash = FastOps().attn_prefill(q, k_pool, v_pool, kv_idx, start, 0.125)
        assert max_diff(out, want) <= max(max_diff(flash, want), 2.0**-7)


def _resident_anon_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon")) / 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_fused_prefill_attention_packs_into_one_workspace_that_grows_resident_only_where_written(
        gen: torch.Generator) -> None:  # fmt: skip
    """The first call makes the workspace with room for every slot of the pools (1 GiB here, for 2^20 slots)
    without making it resident; chunks of a growing context reuse it, each answer exact."""
    from worker_proc.host.memory import zeros

    slots, kv_heads, d = 1 << 20, 2, 64
    k_pool = zeros((slots, kv_heads, d), torch.float32, "cpu")
    v_pool = zeros((slots, kv_heads, d), torch.float32, "cpu")
    kv_idx = torch.randperm(4096, generator=gen)[:700] * 16  # 700 slots spread over the first 64k
    k_pool[kv_idx], v_pool[kv_idx] = rand(gen, 700, kv_heads, d), rand(gen, 700, kv_heads, d)
    ops = _native()
    before = _resident_anon_mib()
    workspace = None
    for start, length in ((0, 100), (100, 300), (400, 300)):
        q = rand(gen, length, 4, d)
        context = kv_idx[: start + length]
        out = ops.attn_prefill(q, k_pool, v_pool, context, start, 0.125)
        workspace = ops._attn_workspace if workspace is None else workspace
        assert ops._attn_workspace is workspace
        assert max_diff(out, _causal_attention(q, k_pool[context], v_pool[context], start, 0.125)) <= TOL
    assert workspace.numel() >= 2 * kv_heads * slots * d
    assert _resident_anon_mib() - before < 64


def test_fused_prefill_attention_falls_back_to_a_workspace_of_the_context_where_the_mapping_is_refused(
        gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A host that commits address space up front may refuse a mapping for the whole pool: the workspace is
    then the context's size, and the answer the same."""
    from worker_proc.kernels.native import ops as native_ops

    def refuse(*args: object, **kwargs: object) -> torch.Tensor:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(native_ops, "zeros", refuse)
    k_pool, v_pool = rand(gen, 4000, 2, 64), rand(gen, 4000, 2, 64)
    kv_idx = torch.randperm(4000, generator=gen)[:150]
    q = rand(gen, 50, 4, 64)
    ops = _native()
    out = ops.attn_prefill(q, k_pool, v_pool, kv_idx, 100, 0.125)
    assert ops._attn_workspace.numel() == 2 * 2 * 192 * 64  # 150 keys padded to blocks of 64
    assert max_diff(out, _causal_attention(q, k_pool[kv_idx], v_pool[kv_idx], 100, 0.125)) <= TOL


def test_fused_prefill_attention_refuses_a_slot_outside_the_pools(gen: torch.Generator) -> None:
    k_pool, v_pool = rand(gen, 40, 2, 64), rand(gen, 40, 2, 64)
    kv_idx = torch.arange(30)
    kv_idx[7] = 40
    with pytest.raises(RuntimeError, match="outside the pools"):
        _native().attn_prefill(rand(gen, 10, 4, 64), k_pool, v_pool, kv_idx, 20, 0.125)
