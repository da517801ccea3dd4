"""The gated delta rule kernels (worker_proc.kernels.gated_delta, gdn_ops) against the definition,
a token-by-token recurrence: chunked prefill with an initial state at lengths around and not
multiple of the 64-token chunk, resuming from the final state at any split, the single-step decode,
pool slots touched only where given; flash-linear-attention against the reference on CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.util import max_diff, pool
from worker_proc.kernels import ReferenceOps, native
from worker_proc.kernels import state_codec as codec
from worker_proc.kernels.gated_delta import gated_delta_chunked, gated_delta_naive, gated_delta_step, l2_normalize
from worker_proc.kernels.gdn_ops import FastGdn, FlaGdn, ReferenceGdn, gdn_choice, make_gdn
from worker_proc.plan.kernel_set import select_ops

TOL = 1e-4
H, DK, DV = 3, 16, 8


def _inputs(gen: torch.Generator, length: int, heads: int = H, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    q = l2_normalize(torch.randn(length, heads, DK, generator=gen))
    k = l2_normalize(torch.randn(length, heads, DK, generator=gen))
    v = torch.randn(length, heads, DV, generator=gen)
    g = -torch.rand(length, heads, generator=gen) * 1.5  # log decays, some near 0, some strong
    beta = torch.rand(length, heads, generator=gen)
    return tuple(t.to(device) for t in (q, k, v, g, beta))


@pytest.mark.parametrize("length", [1, 7, 63, 64, 65, 150])
@pytest.mark.parametrize("chunk", [64, 16, 5])
def test_chunked_equals_the_recurrence(length: int, chunk: int) -> None:
    gen = torch.Generator().manual_seed(length * 100 + chunk)
    q, k, v, g, beta = _inputs(gen, length)
    s0 = torch.randn(H, DK, DV, generator=gen)
    o, s = gated_delta_chunked(q, k, v, g, beta, DK**-0.5, s0, chunk)
    o_ref, s_ref = gated_delta_naive(q, k, v, g, beta, DK**-0.5, s0)
    assert o.shape == (length, H, DV) and s.shape == (H, DK, DV)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    assert max_diff(o, o_ref) <= TOL and max_diff(s, s_ref) <= TOL


@pytest.mark.parametrize("split", [1, 40, 64, 100])
def test_resuming_from_the_final_state_equals_one_call(split: int) -> None:
    gen = torch.Generator().manual_seed(split)
    q, k, v, g, beta = _inputs(gen, 150)
    s0 = torch.zeros(H, DK, DV)
    whole, s_whole = gated_delta_chunked(q, k, v, g, beta, 0.25, s0)
    first, s_mid = gated_delta_chunked(q[:split], k[:split], v[:split], g[:split], beta[:split], 0.25, s0)
    rest, s_end = gated_delta_chunked(q[split:], k[split:], v[split:], g[split:], beta[split:], 0.25, s_mid)
    assert max_diff(torch.cat([first, rest]), whole) <= TOL and max_diff(s_end, s_whole) <= TOL


def test_step_is_one_token_of_the_recurrence_by_hand() -> None:
    gen = torch.Generator().manual_seed(3)
    q, k, v, g, beta = _inputs(gen, 2)
    state = torch.randn(2, H, DK, DV, generator=gen)
    o, new = gated_delta_step(state, q, k, v, g, beta, 0.5)
    for b in range(2):
        for h in range(H):
            s = state[b, h] * torch.exp(g[b, h])
            u = beta[b, h] * (v[b, h] - s.t() @ k[b, h])
            s = s + torch.outer(k[b, h], u)
            assert max_diff(new[b, h], s) <= 1e-5 and max_diff(o[b, h], s.t() @ (0.5 * q[b, h])) <= 1e-5


def test_ops_touch_only_the_given_slots() -> None:
    gen = torch.Generator().manual_seed(4)
    ops = ReferenceOps()
    states = pool(gen, 5, H, DK, DV)
    before = states.clone()
    q, k, v, g, beta = _inputs(gen, 70)
    o = ops.gdn_prefill(q, k, v, g, beta, 0.25, states, 3)
    o_ref, s_ref = gated_delta_naive(q, k, v, g, beta, 0.25, before[3])
    assert max_diff(o, o_ref) <= TOL and max_diff(states[3], s_ref) <= TOL
    untouched = [0, 1, 2, 4, 5]
    assert torch.equal(states[untouched], before[untouched])
    q, k, v, g, beta = _inputs(gen, 2)
    slots = torch.tensor([5, 1])
    mid = states.clone()
    o = ops.gdn_decode(q, k, v, g, beta, 0.25, states, slots)
    o_ref, s_ref = gated_delta_step(mid[slots], q, k, v, g, beta, 0.25)
    assert torch.equal(o, o_ref) and torch.equal(states[slots], s_ref)
    assert torch.equal(states[[0, 2, 3, 4]], mid[[0, 2, 3, 4]])


def test_fast_decode_updates_the_pool_rows_in_place_like_the_reference() -> None:
    gen = torch.Generator().manual_seed(6)
    states = pool(gen, 6, H, DK, DV)
    twin, before = states.clone(), states.clone()
    q, k, v, g, beta = _inputs(gen, 3)
    slots = torch.tensor([4, 1, 6])
    o_fast = FastGdn().step(q, k, v, g, beta, 0.25, states, slots)
    o_ref = ReferenceGdn().step(q, k, v, g, beta, 0.25, twin, slots)
    assert max_diff(o_fast, o_ref) <= 1e-5 and max_diff(states, twin) <= 1e-5
    assert torch.equal(states[[0, 2, 3, 5]], before[[0, 2, 3, 5]])  # rows not given stay bitwise


@pytest.mark.skipif(not native.load(), reason="the fused CPU kernels cannot be built here")
@pytest.mark.parametrize("storage", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("v_dtype", [torch.float32, torch.bfloat16])
def test_native_decode_equals_the_pure_torch_step_in_every_pool_storage(storage: str, v_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    fast, fused = make_gdn("fast"), select_ops("cpu", "native").gdn
    assert type(fused).__name__ == "NativeGdn"
    states = pool(gen, 6, H, DK, DV)

    def stored() -> codec.StatePool:
        if storage == "int8":
            return codec.QuantizedPool(*codec.quantize(states))
        return states.to(getattr(torch, storage)).clone()

    want, got = stored(), stored()
    q, k, v, g, beta = _inputs(gen, 3)
    slots = torch.tensor([4, 1, 6])
    v = v.to(v_dtype)
    o_want = fast.step(q, k, v, g, beta, 0.25, want, slots)
    o_got = fused.step(q, k, v, g, beta, 0.25, got, slots)
    assert o_got.dtype == torch.float32 and max_diff(o_got, o_want) <= 1e-5
    after_want, after_got = codec.load(want, torch.arange(7)), codec.load(got, torch.arange(7))
    step = 0.0 if storage != "int8" else float(got.scale.max()) * 1.01  # an int8 value may round the other way
    assert max_diff(after_got, after_want) <= max(1e-5, step)
    untouched = [0, 2, 3, 5]  # slot 0 (padding) and the rows not given stay bitwise
    assert torch.equal(after_got[untouched], codec.load(stored(), torch.arange(7))[untouched])


@pytest.mark.skipif(not native.load(), reason="the fused CPU kernels cannot be built here")
def test_native_decode_names_bad_input() -> None:
    gen = torch.Generator().manual_seed(8)
    q, k, v, g, beta = _inputs(gen, 2)
    with pytest.raises(RuntimeError, match="not \\[S, heads, key dim, value dim\\]"):
        torch.ops.hyssm_cpu.gdn_decode(q, k, v, g, beta, 0.25, pool(gen, 3, H, DK + 1, DV), None,
                                       torch.tensor([1, 2]))
    with pytest.raises(RuntimeError, match="one per row"):
        torch.ops.hyssm_cpu.gdn_decode(q, k, v, g, beta, 0.25, pool(gen, 3, H, DK, DV), None, torch.tensor([1]))


def test_cpu_selects_the_pure_torch_backends() -> None:
    assert gdn_choice("cpu") == "reference" and gdn_choice("cpu", fast=True) == "fast"
    assert isinstance(make_gdn("reference"), ReferenceGdn) and isinstance(make_gdn("fast"), FastGdn)
    assert isinstance(select_ops("cpu", "auto").gdn, FastGdn) and isinstance(select_ops("cpu", "fast").gdn, FastGdn)
    assert select_ops("cpu", "auto").gdn.name == ("native" if native.load() else "fast")
    assert type(select_ops("cpu", "reference").gdn) is ReferenceGdn
    assert type(select_ops("cpu", "auto", deterministic=True).gdn) is ReferenceGdn


def _fla_skip_reason() -> str:
    if not torch.cuda.is_available():
        return "flash-linear-attention (fla-core) needs a CUDA device; this machine has none"
    try:
        FlaGdn()
    except ImportError as exc:
        return f"fla-core is not installed (pip install hyssm[fla]): {exc}"
    return ""


@pytest.mark.skipif(bool(_fla_skip_reason()), reason=_fla_skip_reason() or "runs")
def test_fla_matches_the_reference_on_cuda() -> None:
    gen = torch.Generator().manual_seed(5)
    fla, ref = FlaGdn(), ReferenceGdn()
    assert gdn_choice("cuda") == "fla" and isinstance(make_gdn("fla"), FlaGdn)
    for length in (1, 70, 150):
        q, k, v, g, beta = _inputs(gen, length, device="cuda")
        pools = [pool(gen, 3, H, DK, DV).cuda() for _ in range(2)]
        pools[1].copy_(pools[0])
        o_fla = fla.chunked(q, k, v, g, beta, DK**-0.5, pools[0], 2)
        o_ref = ref.chunked(q, k, v, g, beta, DK**-0.5, pools[1], 2)
        assert max_diff(o_fla, o_ref) <= TOL and max_diff(pools[0], pools[1]) <= TOL
    q, k, v, g, beta = _inputs(gen, 2, device="cuda")
    slots = torch.tensor([3, 1], device="cuda")
    o_fla = fla.step(q, k, v, g, beta, 0.25, pools[0], slots)
    o_ref = ref.step(q, k, v, g, beta, 0.25, pools[1], slots)
    assert max_diff(o_fla, o_ref) <= TOL and max_diff(pools[0], pools[1]) <= TOL
