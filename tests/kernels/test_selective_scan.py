"""Mamba1's selective scan (worker_proc.kernels.selective_scan): the reference's prefill against the recurrence
written out in float64 token by token, a prompt resumed from its state equal to the whole prompt, the decode
step equal to the prefill of one token; the native kernel (`selective_scan_ops.cpp`, prefill over several
segments and its one-token mode) against the reference for float32, bfloat16 and int8 pools, rows of padding
slot 0 computed from a zero state and never written, and other slots untouched."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker_proc.kernels import ReferenceOps, native
from worker_proc.kernels import state_codec as codec
from worker_proc.kernels.interface import SelectiveScanParams
from worker_proc.kernels.selective_scan import selective_scan, selective_state_step

D, N = 48, 8


def _params(gen: torch.Generator) -> SelectiveScanParams:
    a = -torch.exp(torch.log(torch.rand(D, N, generator=gen) * 6 + 0.5))
    return SelectiveScanParams(a, torch.randn(D, generator=gen), 0.5 * torch.randn(D, generator=gen))


def _inputs(gen: torch.Generator, rows: int) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(rows, width, generator=gen) for width in (D, D, N, N))


def _pool(state_dtype: str, slots: int = 6) -> codec.StatePool:
    values = torch.zeros(slots, D, N, dtype=codec.storage_dtype(state_dtype))
    return codec.QuantizedPool(values, torch.zeros(slots, D)) if state_dtype == "int8" else values


def test_reference_is_the_recurrence() -> None:
    gen = torch.Generator().manual_seed(0)
    p = _params(gen)
    x, dt, b, c = _inputs(gen, 21)
    step = F.softplus(dt.double() + p.dt_bias.double())
    state, want = 0.3 * torch.randn(D, N, generator=gen).double(), []
    start = state.float()
    for t in range(21):
        state = torch.exp(step[t, :, None] * p.a.double()) * state + (step[t] * x[t].double())[:, None] * b[t].double()
        want.append((state * c[t].double()).sum(-1) + p.d.double() * x[t].double())
    y, final = selective_scan(x, step.float(), p.a, b, c, p.d, start)
    assert float((y.double() - torch.stack(want)).abs().max()) < 1e-5
    assert float((final.double() - state).abs().max()) < 1e-5
    # resuming from the state after 8 tokens gives the rest of the prompt; the one-token step is the scan's
    y8, s8 = selective_scan(x[:8], step[:8].float(), p.a, b[:8], c[:8], p.d, start)
    rest, _ = selective_scan(x[8:], step[8:].float(), p.a, b[8:], c[8:], p.d, s8)
    assert torch.allclose(torch.cat([y8, rest]), y, atol=1e-6)
    one, s9 = selective_state_step(s8[None], x[8:9], step[8:9].float(), p.a, b[8:9], c[8:9], p.d)
    assert torch.allclose(one[0], rest[0], atol=1e-6)
    assert torch.allclose(s9[0], selective_scan(x[:9], step[:9].float(), p.a, b[:9], c[:9], p.d, start)[1],
                          atol=1e-6)  # fmt: skip


@pytest.mark.skipif(not native.load(), reason="the fused CPU kernels cannot be built here")
@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16", "int8"])
def test_native_matches_the_reference(state_dtype: str) -> None:
    from worker_proc.kernels.native.ops import NativeOps

    gen = torch.Generator().manual_seed(1)
    p = _params(gen)
    ref, fast = ReferenceOps(), NativeOps()
    pools = [_pool(state_dtype), _pool(state_dtype)]
    spans = ((7, 2), (1, 4), (13, 3))
    x, dt, b, c = _inputs(gen, 21)
    y_ref = ref.selective_scan_prefill_many(x, dt, b, c, p, pools[0], spans)
    y_nat = fast.selective_scan_prefill_many(x, dt, b, c, p, pools[1], spans)
    assert float((y_ref - y_nat).abs().max()) < 1e-4
    slots = torch.tensor([3, 0, 2, 4])  # the native step is given a padding row among them
    x, dt, b, c = _inputs(gen, 4)
    real = torch.tensor([0, 2, 3])
    d_ref = ref.selective_scan_decode(x[real], dt[real], b[real], c[real], p, pools[0], slots[real])
    pool = pools[1]  # the kernel's one-token mode
    values, scale = (pool.values, pool.scale.unsqueeze(2)) if isinstance(pool, codec.QuantizedPool) else (pool, None)
    d_nat = torch.ops.hyssm_cpu.selective_scan(x, dt, b, c, p.a, p.d, p.dt_bias, values.unsqueeze(2), scale, slots, [])
    assert float((d_ref - d_nat[real]).abs().max()) < 1e-4
    loaded = [codec.load(pool, torch.arange(6)) for pool in pools]
    assert float((loaded[0] - loaded[1]).abs().max()) < (1e-4 if state_dtype == "float32" else 0.05)
    assert not loaded[1][[0, 1, 5]].any()  # padding slot 0 and the slots not given stay zero
    assert loaded[1][[2, 3, 4]].abs().sum() > 0


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16", "int8"])
def test_triton_matches_the_reference(state_dtype: str) -> None:
    """The Triton kernel (interpreted here) over several prefill segments and decode rows, against the reference;
    a decode row of padding slot 0 leaves the pool's slot 0 zero."""
    from worker_proc.kernels.triton.ops import TritonOps

    gen = torch.Generator().manual_seed(2)
    p = _params(gen)
    ref, tri = ReferenceOps(), TritonOps()
    pools = [_pool(state_dtype), _pool(state_dtype)]
    spans = ((7, 2), (1, 4), (13, 3))
    x, dt, b, c = _inputs(gen, 21)
    y_ref = ref.selective_scan_prefill_many(x, dt, b, c, p, pools[0], spans)
    y_tri = tri.selective_scan_prefill_many(x, dt, b, c, p, pools[1], spans)
    assert float((y_ref - y_tri).abs().max()) < 1e-4
    x, dt, b, c = _inputs(gen, 3)
    slots = torch.tensor([3, 2, 4])
    d_ref = ref.selective_scan_decode(x, dt, b, c, p, pools[0], slots)
    d_tri = tri.selective_scan_decode(x, dt, b, c, p, pools[1], slots)
    assert float((d_ref - d_tri).abs().max()) < 1e-4
    loaded = [codec.load(pool, torch.arange(6)) for pool in pools]
    assert float((loaded[0] - loaded[1]).abs().max()) < (1e-4 if state_dtype == "float32" else 0.05)
    assert not loaded[1][[0, 1, 5]].any() and loaded[1][[2, 3, 4]].abs().sum() > 0
    if state_dtype == "float32":
        tri.selective_scan_decode(x[:1], dt[:1], b[:1], c[:1], p, pools[1], torch.tensor([0]))
        assert not pools[1][0].any()


@pytest.mark.parametrize("name", ["falcon_mamba", "jamba"])
def test_model_with_triton_ops_matches_transformers(name: str) -> None:
    """A runner whose ops are swapped for `TritonOps` (interpreted): the prompt's logits within 1e-4 of
    transformers' and the greedy decode's logits too (the conv, scan and attention kernels all Triton's)."""
    from safetensors.torch import load_file

    from tests.fixtures.mamba1_model import mamba1_dir
    from tests.worker.util import decode_logit_diffs, runner_at
    from worker_proc.kernels.triton.ops import TritonOps

    ref = load_file(f"{mamba1_dir(name)}/reference.safetensors")
    r = runner_at(mamba1_dir(name), kv_slots=80, deterministic=True)
    r.ops = TritonOps()
    diffs = decode_logit_diffs(r, ref["prompt"].tolist(), ref["gen_tokens"].tolist()[:4], ref["gen_logits"][:4])
    assert max(diffs) <= 1e-4, diffs
