"""`LinearMethod` (worker_proc.linear.formats): one per storage format, the object a product site gets once,
owning the format's weight creation, its copies after loading, its kernels and `apply`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker_proc.linear.formats import (
    DENSE_LINEAR,
    INT4_LINEAR,
    INT8_LINEAR,
    LINEAR_METHODS,
    THROUGHPUT_KERNELS,
)
from worker_proc.linear.kernels import KERNELS
from worker_proc.linear.site import GemmSite

G = torch.Generator().manual_seed(3)


def test_every_kernel_belongs_to_exactly_one_format_and_the_plan_times_every_candidate() -> None:
    owners = {name: [m.storage for m in LINEAR_METHODS.values() if kernel in m.kernels]
              for name, kernel in KERNELS.items()}
    assert all(len(o) == 1 for o in owners.values()), owners
    assert set(THROUGHPUT_KERNELS) == {k for m in LINEAR_METHODS.values() for k in m.candidates}
    for method in LINEAR_METHODS.values():
        assert method.deterministic.batch_invariant and method.reference.batch_invariant or method is DENSE_LINEAR
        assert all(method.reads(k) for k in method.kernels)
        assert "meta" in method.reference.devices  # the reference runs on any device


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_a_site_takes_its_formats_method_once_and_runs_its_reference_until_bound(fmt: str) -> None:
    w = torch.randn(64, 128, generator=G)
    site = GemmSite(64, 128, torch.float32, packable=True)
    assert site.method is DENSE_LINEAR and site.methods == (DENSE_LINEAR.reference,)
    q = LINEAR_METHODS[fmt].create_weight(w)
    assert q is not None and q.fmt == fmt and q.shape == (64, 128)
    site.quantize(q)
    assert site.method is LINEAR_METHODS[fmt] and site.methods == (site.method.reference,)
    x = torch.randn(3, 128, generator=G)
    assert torch.allclose(site.apply(x, torch.empty(0)), F.linear(x, q.dequantize(torch.float32)), atol=1e-4)
    with pytest.raises(ValueError, match=f"cannot read a {fmt} weight"):
        site.bind((), (DENSE_LINEAR.reference,))


def test_int4_falls_back_to_int8_where_its_layout_cannot_hold_the_shape() -> None:
    q = INT4_LINEAR.create_weight(torch.randn(24, 40, generator=G))  # 24 rows: not a multiple of 16
    assert q.fmt == "int8"


def test_process_after_loading_makes_exactly_the_copies_the_bound_kernels_read() -> None:
    w = torch.randn(32, 64, generator=G)
    site = GemmSite(32, 64, torch.float32, packable=True)
    packed = KERNELS["packed"]
    site.bind((), (packed,), w)
    assert set(site.copies) == {"packed"}
    site.check_integrity(w)
    x = torch.randn(5, 64, generator=G)
    assert torch.allclose(site.apply(x, w), F.linear(x, w), atol=1e-5)
    site.bind((), (DENSE_LINEAR.reference,), w)
    assert site.copies == {}

    int8 = GemmSite(32, 64, torch.float32, packable=True)
    int8.quantize(INT8_LINEAR.create_weight(w))
    tiled = KERNELS["tiled_w8a8"]
    if tiled.supports(int8, torch.device("cpu")):
        int8.bind((), (tiled,))
        assert int8.quantized is not None and int8.quantized.tiled is not None
        int8.check_integrity(torch.empty(0))


def test_gathered_kernels_serve_expert_stacks_only_and_compute_what_the_expert_product_does() -> None:
    from worker_proc.kernels import native
    from worker_proc.plan.product_timer import GemmKey

    if not native.load():
        pytest.skip("no native kernels on this machine")
    cpu = torch.device("cpu")
    stack_w = torch.randn(4, 32, 64, generator=G)
    stack = GemmSite(32, 64, torch.float32, packable=False, experts=True)
    single = GemmSite(32, 64, torch.float32, packable=True)
    gathered = [KERNELS[n] for n in ("gathered", "gathered_seq")]
    assert all(k.supports(stack, cpu) and not k.supports(single, cpu) for k in gathered)
    assert GemmKey.of(stack) != GemmKey.of(single) and GemmKey.of(stack).label().endswith("experts")
    x = torch.randn(3, 64, generator=G)
    idx = torch.tensor([[2], [0], [3]])
    for kernel in gathered:
        stack.bind((), (kernel,))
        assert stack.gathers(3)
        want = torch.stack([F.linear(x[t], stack_w[int(idx[t, 0])]) for t in range(3)])
        assert torch.allclose(stack.apply_gathered(x, stack_w, idx, per_choice=False), want, atol=1e-4)
        assert torch.allclose(stack.apply_expert(x, stack_w, 1), F.linear(x, stack_w[1]), atol=1e-4)
    q = INT8_LINEAR.create_weight(stack_w)
    int8 = GemmSite(32, 64, torch.float32, packable=False, experts=True)
    int8.quantize(q)
    int8.bind((), (KERNELS["gathered_int8"],))
    want = torch.stack([F.linear(x[t], q[int(idx[t, 0])].dequantize(torch.float32)) for t in range(3)])
    assert torch.allclose(int8.apply_gathered(x, stack_w, idx, per_choice=False), want, atol=1e-3)
    assert torch.allclose(int8.apply_expert(x, stack_w, 2), F.linear(x, q[2].dequantize(torch.float32)), atol=1e-3)
