"""The recurrent-state codec (worker_proc.kernels.state_codec) and the CPU kernels that use it.

What must hold: int8 round trips within half a quantisation step per row, zero rows stay exactly
zero, stores never leave padding slot 0 non-zero, a decoded state re-encodes to the same bytes
(copies are lossless), and every kernel on a bfloat16 or int8 pool computes exactly what it computes
on a float32 pool holding the decoded states, then encodes the result once.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from worker_proc.kernels import FastOps, ReferenceOps
from worker_proc.kernels import state_codec as codec
from worker_proc.kernels.interface import SsdParams
from worker_proc.kernels.state_codec import QuantizedPool, StatePool


def _states(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Random states [..., H, a, b] whose heads differ in magnitude by up to 1e4, one head all zero."""
    x = torch.randn(*shape, generator=gen)
    head_scale = torch.logspace(-2, 2, shape[-3])
    x = x * head_scale[:, None, None]
    x[..., 1, :, :] = 0.0
    return x


def encode(state: torch.Tensor, state_dtype: str) -> StatePool:
    """A pool of `state_dtype` holding `state` [S, H, a, b] (slot 0 as given)."""
    if state_dtype == "int8":
        return QuantizedPool(*codec.quantize(state))
    return state.to(codec.storage_dtype(state_dtype))


def clone(pool: StatePool) -> StatePool:
    if isinstance(pool, QuantizedPool):
        return QuantizedPool(pool.values.clone(), pool.scale.clone())
    return pool.clone()


def same(a: StatePool, b: StatePool) -> bool:
    if isinstance(a, QuantizedPool):
        assert isinstance(b, QuantizedPool)
        return torch.equal(a.values, b.values) and torch.equal(a.scale, b.scale)
    assert isinstance(b, torch.Tensor)
    return torch.equal(a, b)


def slot0_zero(pool: StatePool) -> bool:
    if isinstance(pool, QuantizedPool):
        return not pool.values[0].any() and not pool.scale[0].any()
    return not pool[0].any()


def test_int8_round_trip_is_within_half_a_step_per_row() -> None:
    gen = torch.Generator().manual_seed(0)
    x = _states(gen, 5, 6, 8, 16)
    x[:, :, 0] *= 1e-3  # a head's rows differ in magnitude: each keeps its own levels
    values, scale = codec.quantize(x)
    assert values.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (5, 6, 8)
    assert values.abs().max() <= 127
    amax = x.abs().amax(dim=-1)
    assert torch.equal(scale, amax / 127)
    err = (codec.dequantize(values, scale) - x).abs().amax(dim=-1)
    assert torch.all(err <= scale * (0.5 + 1e-5))
    # every row uses the full range: the relative error is bounded per row, whatever its magnitude
    live = amax > 0
    assert torch.all(err[live] / amax[live] <= 0.5 / 127 + 1e-6)


def test_zero_rows_have_zero_scale_and_decode_to_zero() -> None:
    x = torch.zeros(3, 4, 2, 5)
    x[1, 2] = torch.arange(10.0).view(2, 5) - 4.5
    values, scale = codec.quantize(x)
    assert scale[1, 2, 0] == 4.5 / 127 and scale[1, 2, 1] == 4.5 / 127 and int((scale != 0).sum()) == 2
    assert not values[0].any() and not values[2].any()
    decoded = codec.dequantize(values, scale)
    assert not decoded[0].any() and not decoded[1, :2].any() and not decoded[1, 3].any()


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_decoded_states_reencode_to_the_same_bytes(state_dtype: str) -> None:
    """store(load(slot)) into another slot reproduces the slot exactly: a copy moves a state losslessly."""
    gen = torch.Generator().manual_seed(1)
    pool = encode(_states(gen, 4, 3, 4, 8), state_dtype)
    codec.store(codec.load(pool, 2), pool, 3)
    copied = codec.load(pool, 3)
    assert torch.equal(copied, codec.load(pool, 2))
    if isinstance(pool, QuantizedPool):
        assert torch.equal(pool.values[3], pool.values[2]) and torch.equal(pool.scale[3], pool.scale[2])
    else:
        assert torch.equal(pool[3], pool[2])


def test_bfloat16_store_rounds_to_nearest_and_load_widens() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 2, 4, 4, generator=gen)
    pool = torch.zeros(4, 2, 4, 4, dtype=torch.bfloat16)
    codec.store(x, pool, torch.tensor([1, 2, 3]))
    assert torch.equal(pool[1:], x.to(torch.bfloat16))
    loaded = codec.load(pool, torch.tensor([3, 1]))
    assert loaded.dtype == torch.float32 and torch.equal(loaded, x[[2, 0]].to(torch.bfloat16).float())


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_stores_never_leave_padding_slot_zero_written(state_dtype: str) -> None:
    """Rows for slot 0 (the Triton kernels' padding rows) are dropped; the other rows are stored."""
    gen = torch.Generator().manual_seed(3)
    pool = encode(torch.zeros(4, 3, 4, 8), state_dtype)
    update = _states(gen, 3, 3, 4, 8) + 1.0
    codec.store(update, pool, torch.tensor([2, 0, 3]))
    assert slot0_zero(pool)
    assert torch.allclose(codec.load(pool, 2), update[0], rtol=1e-2, atol=0.05 * float(update[0].abs().max()))
    assert codec.load(pool, 1).abs().max() == 0


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_run_on_float32_gives_the_kernel_a_float32_pool_of_the_slots(state_dtype: str) -> None:
    gen = torch.Generator().manual_seed(4)
    state = _states(gen, 5, 3, 2, 4)
    state[0] = 0
    pool = encode(state, state_dtype)
    seen: list[torch.Tensor] = []

    def kernel(rows: torch.Tensor, local: torch.Tensor) -> str:
        assert rows.dtype == torch.float32 and rows.is_contiguous() and not rows[0].any()
        assert local.tolist() == [1, 2]
        seen.append(rows.clone())
        rows[local] = rows[local] * 2.0 + 1.0
        return "out"

    before = codec.load(pool, torch.arange(5))
    assert codec.run_on_float32(pool, torch.tensor([4, 1]), kernel) == "out"
    assert torch.equal(seen[0][1:], before[[4, 1]])
    expected = encode(before[[4, 1]] * 2.0 + 1.0, state_dtype)
    assert torch.equal(codec.load(pool, torch.tensor([4, 1])), codec.load(expected, torch.arange(2)))
    assert torch.equal(codec.load(pool, torch.tensor([2, 3])), before[[2, 3]])  # other slots untouched


def test_unknown_state_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="float32, bfloat16, int8"):
        codec.storage_dtype("float8")


# ----------------------------------------------------------------------------- the CPU kernels

Case = Callable[[object, StatePool], torch.Tensor]


def _cases(gen: torch.Generator) -> dict[str, tuple[Case, tuple[int, ...], list[int]]]:
    """name -> (run(ops, pool) -> output, the per-slot state shape, the slots it writes)."""
    heads, p, groups, n, hv, dk, dv = 4, 8, 2, 16, 3, 8, 6
    xs, dt = torch.randn(13, heads, p, generator=gen), torch.randn(13, heads, generator=gen)
    bm, cm = torch.randn(13, groups, n, generator=gen), torch.randn(13, groups, n, generator=gen)
    params = SsdParams(-torch.rand(heads, generator=gen) - 0.1, torch.randn(heads, generator=gen),
                       torch.randn(heads, generator=gen), (0.0, float("inf")), 4)  # fmt: skip
    q = torch.nn.functional.normalize(torch.randn(13, hv, dk, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(13, hv, dk, generator=gen), dim=-1)
    v, g = torch.randn(13, hv, dv, generator=gen), -torch.rand(13, hv, generator=gen)
    beta = torch.rand(13, hv, generator=gen)
    dec = torch.tensor([4, 2])
    ssm, gdn = (heads, p, n), (hv, dk, dv)
    return {
        "ssd_prefill": (lambda ops, sp: ops.ssd_prefill(xs, dt, bm, cm, params, sp, 1), ssm, [1]),
        "ssd_prefill_many": (lambda ops, sp: ops.ssd_prefill_many(xs[:12], dt[:12], bm[:12], cm[:12], params, sp,
                                                                  ((6, 3), (6, 1))), ssm, [3, 1]),  # fmt: skip
        "ssd_decode": (lambda ops, sp: ops.ssd_decode(xs[:2], dt[:2], bm[:2], cm[:2], params, sp, dec), ssm, [4, 2]),
        "gdn_prefill": (lambda ops, sp: ops.gdn_prefill(q, k, v, g, beta, 0.3, sp, 3), gdn, [3]),
        "gdn_decode": (lambda ops, sp: ops.gdn_decode(q[:2], k[:2], v[:2], g[:2], beta[:2], 0.3, sp, dec), gdn, [4, 2]),
    }


@pytest.mark.parametrize("ops_name", ["reference", "fast"])
@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("case", ["ssd_prefill", "ssd_prefill_many", "ssd_decode", "gdn_prefill", "gdn_decode"])
def test_kernels_update_the_decoded_state_in_float32_and_encode_it_once(ops_name: str, state_dtype: str,
                                                                        case: str) -> None:  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    run, shape, written = _cases(gen)[case]
    ops = ReferenceOps() if ops_name == "reference" else FastOps()
    start = torch.randn(5, *shape, generator=gen) * 0.5
    start[0] = 0
    start[1] = 0  # a fresh request's state
    pool = encode(start, state_dtype)
    decoded = codec.load(pool, torch.arange(5))  # the float32 pool the kernel should see
    want_out = run(ops, decoded)  # updates `decoded` in float32
    before = clone(pool)
    got_out = run(ops, pool)
    assert torch.equal(got_out, want_out)
    slots = torch.tensor(written)
    want_pool = encode(decoded[slots], state_dtype)
    assert torch.equal(codec.load(pool, slots), codec.load(want_pool, torch.arange(len(written))))
    kept = torch.tensor([s for s in range(5) if s not in written])
    assert torch.equal(codec.load(pool, kept), codec.load(before, kept)) and slot0_zero(pool)
    assert not same(pool, before)


def test_every_flag_value_has_a_storage() -> None:
    assert set(codec.STORAGE) == set(codec.STATE_DTYPES) == {"float32", "bfloat16", "int8"}
