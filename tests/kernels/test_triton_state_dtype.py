"""`TritonOps` (interpreted) on bfloat16 and int8 SSM pools: the kernels run on a float32 scratch of the
call's slots (worker_proc.kernels.state_codec.run_on_float32), so the result is exactly the float32
kernels' on the decoded states, encoded once; padding rows (slot 0) are computed, never written."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.util import rand, strided
from worker_proc.kernels import state_codec as codec
from worker_proc.kernels.interface import SsdParams
from worker_proc.kernels.state_codec import QuantizedPool, StatePool
from worker_proc.kernels.triton.ops import TritonOps


def _encode(state: torch.Tensor, state_dtype: str) -> StatePool:
    if state_dtype == "int8":
        return QuantizedPool(*codec.quantize(state))
    return state.to(codec.storage_dtype(state_dtype))


def _slot0_zero(pool: StatePool) -> bool:
    if isinstance(pool, QuantizedPool):
        return not pool.values[0].any() and not pool.scale[0].any()
    return not pool[0].any()


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_triton_ssd_on_encoded_pools_equals_float32_on_the_decoded_states(gen: torch.Generator,
                                                                         state_dtype: str) -> None:  # fmt: skip
    heads, p, groups, n = 4, 8, 2, 16
    xs = strided(rand(gen, 11, heads, p))
    dt, bm, cm = rand(gen, 11, heads), rand(gen, 11, groups, n), rand(gen, 11, groups, n)
    params = SsdParams(-torch.rand(heads, generator=gen) - 0.1, rand(gen, heads), rand(gen, heads),
                       (0.0, float("inf")), 4)  # fmt: skip
    start = rand(gen, 5, heads, p, n)
    start[0] = 0
    start[1] = 0
    ops = TritonOps()
    cases = (
        (lambda sp: ops.ssd_prefill(xs, dt, bm, cm, params, sp, 1), [1]),
        (lambda sp: ops.ssd_decode(xs[:3], dt[:3], bm[:3], cm[:3], params, sp, torch.tensor([4, 0, 2])), [4, 2]),
    )
    for run, written in cases:
        pool = _encode(start, state_dtype)
        decoded = codec.load(pool, torch.arange(5)).contiguous()
        want = run(decoded)
        got = run(pool)
        assert torch.equal(got, want)
        slots = torch.tensor(written)
        want_rows = codec.load(_encode(decoded[slots], state_dtype), torch.arange(len(written)))
        assert torch.equal(codec.load(pool, slots), want_rows)
        kept = torch.tensor([s for s in range(1, 5) if s not in written])
        assert torch.equal(codec.load(pool, kept), codec.load(_encode(start, state_dtype), kept))
        assert _slot0_zero(pool)  # the decode's padding row was computed but not written
