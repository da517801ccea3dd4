"""`TritonOps` (interpreted) against `ReferenceOps`: same methods, same signatures, same results; `select_ops`."""

from __future__ import annotations

import inspect
import sys

import pytest
import torch

from tests.kernels.util import TOL, max_diff, pool, rand, strided, untouched
from worker_proc.kernels import FastOps, KernelOps, ReferenceOps
from worker_proc.kernels.interface import SsdParams
from worker_proc.kernels.triton.ops import TritonOps
from worker_proc.plan.kernel_set import select_ops

METHODS = ("conv_prefill", "conv_decode", "ssd_prefill", "ssd_decode", "attn_prefill", "attn_decode", "mamba_decode",
           "gate_norm", "rms_norm")


def test_interpreter_is_active() -> None:
    """Every kernel of this suite runs interpreted (the conftest imported them with TRITON_INTERPRET=1)."""
    from triton.runtime.interpreter import InterpretedFunction

    from worker_proc.kernels.triton import attention as triton_attention
    from worker_proc.kernels.triton import conv as triton_conv
    from worker_proc.kernels.triton import ssd as triton_ssd
    from worker_proc.kernels.triton import ssd_step as triton_ssd_step

    kernels = [
        getattr(m, name)
        for m in (triton_attention, triton_conv, triton_ssd, triton_ssd_step)
        for name in dir(m)
        if name.startswith("_") and name.endswith("_kernel")
    ]
    assert len(kernels) == 11  # 3 attention, 3 conv, 4 SSD scan, 1 SSD step
    assert all(isinstance(k, InterpretedFunction) for k in kernels)


@pytest.mark.parametrize("method", METHODS)
def test_same_signatures_as_the_interface(method: str) -> None:
    want = inspect.signature(getattr(KernelOps, method))
    for impl in (TritonOps, ReferenceOps, FastOps):
        assert inspect.signature(getattr(impl, method)) == want, impl


def test_select_ops() -> None:
    assert isinstance(select_ops("cpu"), FastOps) and not select_ops("cpu").batch_invariant
    assert isinstance(select_ops("cpu", deterministic=True), ReferenceOps)
    assert select_ops("cpu", deterministic=True).batch_invariant
    assert isinstance(select_ops("cpu", "reference"), ReferenceOps)
    assert not select_ops("cpu", "reference").batch_invariant  # invariant exactly in the deterministic mode
    assert isinstance(select_ops(torch.device("cpu"), "triton"), TritonOps)  # interpreter on
    assert isinstance(select_ops("cuda:0"), TritonOps)
    assert isinstance(select_ops("cuda:0", deterministic=True), TritonOps)  # Triton kernels are invariant
    assert select_ops("cuda:0").batch_invariant
    assert isinstance(select_ops("cuda", "reference"), ReferenceOps)
    assert not select_ops("cuda", "reference").batch_invariant
    assert select_ops("cuda", "reference", deterministic=True).batch_invariant
    with pytest.raises(ValueError, match="unknown kernel"):
        select_ops("cpu", "cutlass")
    with pytest.raises(ValueError, match="not batch invariant"):
        select_ops("cpu", "fast", deterministic=True)


def test_select_ops_refuses_triton_on_cpu_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker_proc.kernels.triton import common as triton_common

    assert triton_common.INTERPRETED
    monkeypatch.setattr(triton_common, "INTERPRETED", False)  # as in a process that compiles its kernels
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        select_ops("cpu", "triton")


def test_select_ops_without_triton(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    for name in ("worker_proc.kernels.triton.common", "worker_proc.kernels.triton.ops"):
        monkeypatch.setitem(sys.modules, name, None)  # importing it now raises ImportError
    assert isinstance(select_ops("cuda"), ReferenceOps)
    assert "triton cannot be imported" in caplog.text
    with pytest.raises(ValueError, match="cannot be imported"):
        select_ops("cuda", "triton")


def _both(fn, *pools: torch.Tensor):
    """Run fn(ops, *pools) for both implementations on copies of the pools: (ref out, ref pools, mine...)."""
    ref_pools = [p.clone() for p in pools]
    my_pools = [p.clone() for p in pools]
    return fn(ReferenceOps(), *ref_pools), ref_pools, fn(TritonOps(), *my_pools), my_pools


def test_conv_and_ssd_methods(gen: torch.Generator) -> None:
    cd, heads, p, groups, n = 40, 4, 8, 2, 16
    weight, bias = rand(gen, cd, 4), rand(gen, cd)
    x = strided(rand(gen, 11, cd))
    conv = pool(gen, 4, cd, 3, zero=(3,))
    for run, written in (
        (lambda ops, cp: ops.conv_prefill(x, cp, 3, weight, bias), [3]),
        (lambda ops, cp: ops.conv_decode(x[:3], cp, torch.tensor([2, 4, 1]), weight, None), [2, 4, 1]),
    ):
        ro, (rp,), mo, (mp,) = _both(run, conv)
        assert max_diff(mo, ro) <= TOL and max_diff(mp, rp) <= TOL and untouched(conv, mp, written)
    xs = strided(rand(gen, 11, heads, p))
    dt, bm, cm = rand(gen, 11, heads), rand(gen, 11, groups, n), rand(gen, 11, groups, n)
    a, d, dt_bias = -torch.rand(heads, generator=gen) - 0.1, rand(gen, heads), rand(gen, heads)
    ssm = pool(gen, 4, heads, p, n, zero=(1,))
    decode_slots = torch.tensor([4, 2])
    for run, written in (
        (lambda ops, sp: ops.ssd_prefill(xs, dt, bm, cm, SsdParams(a, d, dt_bias, (0.0, float("inf")), 4), sp, 1), [1]),
        (
            lambda ops, sp: ops.ssd_decode(xs[:2], dt[:2], bm[:2], cm[:2], SsdParams(a, d, dt_bias, (0.1, 3.0), 4), sp,
                                           decode_slots),
            [4, 2],
        ),
    ):
        ro, (rp,), mo, (mp,) = _both(run, ssm)
        assert max_diff(mo, ro) <= TOL and max_diff(mp, rp) <= TOL and untouched(ssm, mp, written)


def test_attention_methods(gen: torch.Generator) -> None:
    k_pool, v_pool = rand(gen, 50, 2, 16), rand(gen, 50, 2, 16)
    q = rand(gen, 6, 4, 16)
    kv = torch.randperm(49, generator=gen)[:10] + 1
    ref_out = ReferenceOps().attn_prefill(q, k_pool, v_pool, kv, 4, 0.2)
    assert max_diff(TritonOps().attn_prefill(q, k_pool, v_pool, kv, 4, 0.2), ref_out) <= TOL
    with pytest.raises(ValueError, match="kv_idx"):
        TritonOps().attn_prefill(q, k_pool, v_pool, kv, 5, 0.2)
    kv_idx = torch.stack([kv, torch.cat([kv[:3], torch.zeros(7, dtype=torch.int64)])])
    lens = torch.tensor([10, 3])
    ref_out = ReferenceOps().attn_decode(q[:2], k_pool, v_pool, kv_idx, lens, 0.2)
    assert max_diff(TritonOps().attn_decode(q[:2], k_pool, v_pool, kv_idx, lens, 0.2), ref_out) <= TOL
