"""Kimi Delta Attention's fused CPU kernel (`delta_ops.cpp` `kda_rule`, `NativeKda`) against the pure-torch rule
(`ReferenceKda`): the decode step and the prefill of several segments in every state storage (float32, bfloat16,
int8), head counts and key / value widths on and off the kernel's 16- and 64-column blocks, each slot's state
read and written at its own slot only (padding slot 0 never written in an encoded pool); a decay equal on every
channel is Gated DeltaNet's step (`gdn_decode`, the same kernel); inputs the kernel does not hold take the
reference; the native kernel set selects it."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.util import max_diff
from worker_proc.kernels import native
from worker_proc.kernels import state_codec as codec
from worker_proc.kernels.gated_delta import l2_normalize
from worker_proc.kernels.kda_ops import ReferenceKda
from worker_proc.plan.kernel_set import choose_kernels

pytestmark = pytest.mark.skipif(not native.load(), reason="the fused CPU kernels cannot be built here")

REL = 1e-5
"""float32 bound of the kernel against the reference, relative to the reference's largest magnitude."""
BF16_STEP = 2.0**-7
"""A bfloat16 state value may round the other way: one step of its 8-bit significand, at most 2^-7 of it."""
SHAPES = [(3, 16, 8), (2, 13, 7), (4, 16, 16), (1, 24, 24), (2, 37, 80), (1, 128, 128), (2, 130, 67)]
"""(heads, Dk, Dv): Kimi's test shapes, widths below, on and across the 16- and 64-column blocks, a realistic head."""


def _native():  # imported here: the class exists only where the library loads
    from worker_proc.kernels.native.ops import NativeKda

    return NativeKda()


def _inputs(gen: torch.Generator, rows: int, heads: int, dk: int, dv: int) -> tuple[torch.Tensor, ...]:
    q = l2_normalize(torch.randn(rows, heads, dk, generator=gen))
    k = l2_normalize(torch.randn(rows, heads, dk, generator=gen))
    v = torch.randn(rows, heads, dv, generator=gen)
    g = -torch.rand(rows, heads, dk, generator=gen) * 1.5  # per-channel log decays, some near 0, some strong
    beta = torch.rand(rows, heads, generator=gen)
    return q, k, v, g, beta


def _pools(gen: torch.Generator, storage: str, slots: int, heads: int, dk: int, dv: int) -> tuple[codec.StatePool, ...]:
    """Two equal pools [slots + 1, H, Dk, Dv] in `storage`, slot 0 (padding) zero."""
    states = torch.randn(slots + 1, heads, dk, dv, generator=gen)
    states[0] = 0

    def stored() -> codec.StatePool:
        if storage == "int8":
            return codec.QuantizedPool(*codec.quantize(states))
        return states.to(codec.STORAGE[storage]).clone()

    return stored(), stored()


def _states_agree(got: codec.StatePool, want: codec.StatePool, storage: str) -> bool:
    """Every slot's decoded state within float32 rounding of the reference's, or one encoding step of it."""
    slots = torch.arange(codec.state_shape(want)[0])
    a, b = codec.load(got, slots), codec.load(want, slots)
    bound = REL * max(1.0, float(b.abs().max()))
    if storage == "bfloat16":
        return bool(((a - b).abs() <= BF16_STEP * b.abs() + bound).all())
    if storage == "int8":  # an int8 value may round the other way: one step of its row's scale
        return bool(((a - b).abs() <= got.scale[..., None] * 1.01 + bound).all())
    return max_diff(a, b) <= bound


def _copy(pool: codec.StatePool) -> codec.StatePool:
    if isinstance(pool, codec.QuantizedPool):
        return codec.QuantizedPool(pool.values.clone(), pool.scale.clone())
    return pool.clone()


def _unchanged(pool: codec.StatePool, before: codec.StatePool, slots: list[int]) -> bool:
    index = torch.tensor(slots)
    return bool(torch.equal(codec.load(pool, index), codec.load(before, index)))


@pytest.mark.parametrize("storage", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize(("heads", "dk", "dv"), SHAPES)
def test_decode_equals_the_reference_step(storage: str, heads: int, dk: int, dv: int) -> None:
    gen = torch.Generator().manual_seed(heads * 1000 + dk * 10 + dv)
    slots = torch.tensor([4, 1, 6])
    for v_dtype in (torch.float32, torch.bfloat16):
        got, want = _pools(gen, storage, 6, heads, dk, dv)
        before = _copy(got)
        q, k, v, g, beta = _inputs(gen, 3, heads, dk, dv)
        v = v.to(v_dtype)
        o_want = ReferenceKda().step(q, k, v, g, beta, dk**-0.5, want, slots)
        o_got = _native().step(q, k, v, g, beta, dk**-0.5, got, slots)
        assert o_got.dtype == torch.float32 and o_got.shape == (3, heads, dv)
        assert max_diff(o_got, o_want) <= REL * max(1.0, float(o_want.abs().max()))
        assert _states_agree(got, want, storage)
        assert _unchanged(got, before, [0, 2, 3, 5])  # slot 0 (padding) and the slots not given stay bitwise


@pytest.mark.parametrize("storage", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize(("heads", "dk", "dv"), SHAPES[:5])
def test_prefill_of_several_segments_equals_the_reference(storage: str, heads: int, dk: int, dv: int) -> None:
    gen = torch.Generator().manual_seed(heads * 7 + dk * 3 + dv)
    got, want = _pools(gen, storage, 5, heads, dk, dv)
    before = _copy(got)
    spans = ((33, 3), (1, 5), (70, 1))  # across the reference's 32-token chunks, and one token alone
    q, k, v, g, beta = _inputs(gen, sum(n for n, _ in spans), heads, dk, dv)
    o_want = ReferenceKda().prefill_many(q, k, v, g, beta, 0.3, want, spans)
    o_got = _native().prefill_many(q, k, v, g, beta, 0.3, got, spans)
    assert o_got.dtype == torch.float32 and o_got.shape == o_want.shape
    assert max_diff(o_got, o_want) <= REL * max(1.0, float(o_want.abs().max()))
    assert _states_agree(got, want, storage)
    assert _unchanged(got, before, [0, 2, 4])


def test_prefill_touches_only_its_slots_and_resumes_from_its_state() -> None:
    gen = torch.Generator().manual_seed(11)
    heads, dk, dv = 2, 20, 12
    pool, _ = _pools(gen, "float32", 5, heads, dk, dv)
    before = pool.clone()
    q, k, v, g, beta = _inputs(gen, 50, heads, dk, dv)
    kda = _native()
    whole = kda.chunked(q, k, v, g, beta, 0.25, pool, 2)
    split = before.clone()
    first = kda.prefill_many(q[:17], k[:17], v[:17], g[:17], beta[:17], 0.25, split, ((17, 2),))
    rest = kda.step(q[17:18], k[17:18], v[17:18], g[17:18], beta[17:18], 0.25, split, torch.tensor([2]))
    tail = kda.chunked(q[18:], k[18:], v[18:], g[18:], beta[18:], 0.25, split, 2)
    assert max_diff(torch.cat([first, rest, tail]), whole) <= REL and max_diff(split, pool) <= REL
    assert torch.equal(pool[[0, 1, 3, 4, 5]], before[[0, 1, 3, 4, 5]]) and not torch.equal(pool[2], before[2])


def test_a_decay_equal_on_every_channel_is_gated_deltanets_step() -> None:
    gen = torch.Generator().manual_seed(12)
    heads, dk, dv = 3, 24, 40
    pool, twin = _pools(gen, "float32", 4, heads, dk, dv)
    q, k, v, g, beta = _inputs(gen, 2, heads, dk, dv)
    scalar = g[..., 0].contiguous()
    slots = torch.tensor([3, 2])
    o_kda = torch.ops.hyssm_cpu.kda_rule(q, k, v, scalar[..., None].expand_as(g), beta, 0.2, pool, None, slots, [])
    o_gdn = torch.ops.hyssm_cpu.gdn_decode(q, k, v, scalar, beta, 0.2, twin, None, slots)
    assert torch.equal(o_kda, o_gdn) and torch.equal(pool, twin)


def test_inputs_the_kernel_does_not_hold_take_the_reference() -> None:
    gen = torch.Generator().manual_seed(13)
    heads, dk, dv = 2, 8, 8
    pool, twin = _pools(gen, "float32", 3, heads, dk, dv)
    q, k, v, g, beta = (t.to(torch.float64) for t in _inputs(gen, 4, heads, dk, dv))
    o_native = _native().prefill_many(q, k, v, g, beta, 0.5, pool, ((3, 1), (1, 2)))
    o_ref = ReferenceKda().prefill_many(q, k, v, g, beta, 0.5, twin, ((3, 1), (1, 2)))
    assert torch.equal(o_native, o_ref) and torch.equal(pool, twin)
    o_native = _native().step(q[:2], k[:2], v[:2], g[:2], beta[:2], 0.5, pool, torch.tensor([3, 1]))
    o_ref = ReferenceKda().step(q[:2], k[:2], v[:2], g[:2], beta[:2], 0.5, twin, torch.tensor([3, 1]))
    assert torch.equal(o_native, o_ref) and torch.equal(pool, twin)


def test_the_kernel_names_bad_input() -> None:
    gen = torch.Generator().manual_seed(14)
    q, k, v, g, beta = _inputs(gen, 3, 2, 8, 4)
    pool, _ = _pools(gen, "float32", 3, 2, 8, 4)
    rule = torch.ops.hyssm_cpu.kda_rule
    with pytest.raises(RuntimeError, match="g \\[T, H, Dk\\]"):
        rule(q, k, v, g[..., 0], beta, 0.5, pool, None, torch.tensor([1, 2, 3]), [])
    with pytest.raises(RuntimeError, match="do not add up"):
        rule(q, k, v, g, beta, 0.5, pool, None, torch.tensor([1, 2]), [1, 1])
    with pytest.raises(RuntimeError, match="one slot per segment"):
        rule(q, k, v, g, beta, 0.5, pool, None, torch.tensor([1]), [1, 2])
    with pytest.raises(RuntimeError, match="not \\[S, heads, key dim, value dim\\]"):
        rule(q, k, v, g, beta, 0.5, _pools(gen, "float32", 3, 2, 8, 5)[0], None, torch.tensor([1, 2, 3]), [])


def test_the_native_kernel_set_selects_it() -> None:
    assert choose_kernels("cpu", "native", has_gdn=False, has_kda=True).build().kda.name == "native"
    assert choose_kernels("cpu", "auto", has_gdn=False, has_kda=True).kda == "native"
    assert choose_kernels("cpu", "fast", has_kda=True).kda == "reference"
    assert choose_kernels("cpu", "auto", deterministic=True, has_kda=True).kda == "reference"
    assert choose_kernels("cpu", "native", has_kda=False).kda == ""
