"""The residual stream between sublayers (worker_proc.model.residual): a held-back output is added exactly
once, by the norm that reads the stream next or by asking for the stream's value."""

from __future__ import annotations

import torch

from worker_proc.kernels import FastOps
from worker_proc.model.layers import RMSNorm
from worker_proc.model.residual import Residual


def _norm() -> RMSNorm:
    norm = RMSNorm(16, 1e-6, torch.bfloat16, torch.device("cpu"))
    norm.weight.data = torch.linspace(0.5, 1.5, 16, dtype=torch.bfloat16)
    return norm


def test_a_held_output_is_added_once_by_the_next_norm() -> None:
    gen = torch.Generator().manual_seed(0)
    h, y1, y2 = (torch.randn(5, 16, generator=gen).to(torch.bfloat16) for _ in range(3))
    ops, norm = FastOps(), _norm()
    stream = Residual(h)
    assert torch.equal(stream.normed(norm, ops), norm(h))  # nothing held: the norm of h
    stream.add(y1, 0.22, ops)
    after_first = torch.add(h, y1, alpha=0.22)
    assert torch.equal(stream.normed(norm, ops), norm(after_first))
    assert torch.equal(stream.value(ops), after_first)  # added by the norm, not again
    stream.add(y1, 1.0, ops)
    stream.add(y2, 1.0, ops)  # a second output before any norm: the first is added first
    assert torch.equal(stream.value(ops), after_first + y1 + y2)


def test_the_norm_of_some_rows_leaves_the_stream_as_it_was() -> None:
    gen = torch.Generator().manual_seed(1)
    h, y = (torch.randn(6, 16, generator=gen).to(torch.bfloat16) for _ in range(2))
    ops, norm = FastOps(), _norm()
    stream = Residual(h)
    stream.add(y, 1.0, ops)
    rows = torch.tensor([5])
    assert torch.equal(stream.normed(norm, ops, rows=rows), norm((h + y)[rows]))
    assert stream.pending is y and stream.h is h
    assert torch.equal(stream.value(ops), h + y)


def test_a_float32_stream_sums_in_float32_and_each_norm_reads_it_rounded() -> None:
    """`fp32` (residual_in_fp32) in a bfloat16 model: outputs are summed in float32, a sublayer's norm reads the
    sum rounded to bfloat16, the final norm reads the float32 sum itself and rounds its product once."""
    gen = torch.Generator().manual_seed(2)
    h, y1, y2 = (torch.randn(6, 16, generator=gen).to(torch.bfloat16) for _ in range(3))
    ops, norm = FastOps(), _norm()
    stream = Residual(h, fp32=True)
    stream.add(y1, 1.0, ops)
    exact = h.float() + y1.float()
    assert not torch.equal(exact.to(torch.bfloat16).float(), exact)  # the test's sums need float32
    assert torch.equal(stream.normed(norm, ops), norm(exact.to(torch.bfloat16)))
    stream.add(y2, 0.5, ops)
    rows = torch.tensor([1, 4])
    whole = exact.add(y2.float(), alpha=0.5)
    final = stream.final_normed(norm, ops, rows=rows)
    assert final.dtype == torch.bfloat16 and stream.pending is y2
    hf = whole[rows] * torch.rsqrt(whole[rows].pow(2).mean(-1, keepdim=True) + norm.eps)  # transformers' MambaRMSNorm
    assert torch.equal(final, (norm.weight * hf).to(torch.bfloat16))
    assert torch.equal(stream.value(ops), whole)
    assert not Residual(h.float(), fp32=True).fp32  # a float32 model's stream is float32 either way
